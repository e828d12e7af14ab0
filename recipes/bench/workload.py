"""The benchmark's workload: a ``BertForMaskedLM`` built from a config, and masked-LM batches.

Two kinds of data (``--data``):

- ``text`` (default): the embedded offline corpus of ``recipes/pretrain.py`` (docstrings of this Python's
  standard library) through a byte-level BPE tokenizer trained on it, cut into ``seq_len``-token blocks.
  The parent prepares the blocks once (:func:`prepare_text_blocks`); every rank loads them.
- ``synthetic``: a language where each token is one of 4 fixed successors of the previous one. Its
  gradients may be of very low rank (PowerSGD at rank 4 tracked DDP fp32's loss to 1e-4 on it), so it
  flatters low-rank compressors; it is kept for the figures measured on it earlier.

Every rank gets different sequences; every method gets the same ones. 15% of positions are masked.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

MASK_ID = 3  # synthetic data: ids 0..3 are reserved (pad, cls, sep, mask); the language uses the rest
FIRST_WORD_ID = 4
DATA_CHOICES = ("text", "synthetic")


def build_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """A ``BertForMaskedLM`` from a ``BertConfig`` (random init, seeded; nothing downloaded)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        intermediate_size=cfg["intermediate"],
        max_position_embeddings=max(cfg["seq_len"], 16),
        pad_token_id=0,
    )
    torch.manual_seed(cfg["seed"])
    return BertForMaskedLM(config)


def prepare_text_blocks(cfg: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Parent side: corpus, tokenizer and token blocks for ``--data text``; returns what the ranks need.

    Writes ``blocks.pt`` (an int64 tensor of shape ``(n, seq_len)``) to ``out_dir``. The model's vocabulary
    becomes the tokenizer's.
    """
    recipes = str(Path(__file__).resolve().parents[1])
    if recipes not in sys.path:
        sys.path.insert(0, recipes)
    import pretrain  # the pre-training recipe's corpus and tokenizer

    texts = pretrain.embedded_corpus(cfg["corpus_chars"])
    tok_args = SimpleNamespace(tokenizer_name=None, vocab_size=cfg["vocab"])
    tokenizer = pretrain.build_tokenizer(tok_args, texts, out_dir / "tokenizer")
    blocks = pretrain.make_blocks(tokenizer, texts, cfg["seq_len"])
    path = out_dir / "blocks.pt"
    torch.save(blocks, path)
    return {
        "blocks_path": str(path),
        "vocab": len(tokenizer),
        "mask_id": tokenizer.mask_token_id,
        "text_sequences": int(blocks.shape[0]),
        "text_chars": sum(len(t) for t in texts),
    }


def _mask(tokens: torch.Tensor, mask_id: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask 15% of positions (at least one per sequence): ``(inputs, labels)`` with -100 where unmasked."""
    masked = torch.rand(tokens.shape, generator=gen) < 0.15
    masked[:, 0] |= ~masked.any(dim=1)
    labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
    inputs = torch.where(masked, torch.full_like(tokens, mask_id), tokens)
    return inputs, labels


def _text_tokens(cfg: dict[str, Any], rank: int, rows: int) -> torch.Tensor:
    """``rows`` blocks for ``rank``: one shuffle shared by all ranks, then every ``world``-th block (cycled)."""
    blocks = torch.load(cfg["blocks_path"], weights_only=True)
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(cfg["seed"]))
    mine = order[rank :: cfg["nproc"]]
    idx = mine[torch.arange(rows) % len(mine)]  # a long run goes round the corpus again
    return blocks[idx]


def _synthetic_tokens(cfg: dict[str, Any], rank: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """Each token one of 4 fixed successors of the previous one; first tokens and successors Zipf-distributed."""
    vocab, length = cfg["vocab"], cfg["seq_len"]
    lang = torch.Generator().manual_seed(cfg["seed"])
    zipf = 1.0 / torch.arange(1, vocab - FIRST_WORD_ID + 1, dtype=torch.float64)
    successors = torch.multinomial(zipf, vocab * 4, replacement=True, generator=lang).view(vocab, 4) + FIRST_WORD_ID
    tokens = torch.empty(rows, length, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(zipf, rows, replacement=True, generator=gen) + FIRST_WORD_ID
    choice = torch.randint(0, 4, (rows, length), generator=gen)
    for i in range(1, length):
        tokens[:, i] = successors[tokens[:, i - 1], choice[:, i]]
    return tokens


def make_batches(cfg: dict[str, Any], rank: int, n_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_steps`` masked-LM batches ``(input_ids, labels)`` of ``batch_size`` sequences for ``rank``."""
    batch = cfg["batch_size"]
    rows = n_steps * batch
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + 17 + rank)
    if cfg["data"] == "synthetic":
        tokens, mask_id = _synthetic_tokens(cfg, rank, rows, gen), MASK_ID
    else:
        tokens, mask_id = _text_tokens(cfg, rank, rows), cfg["mask_id"]
    inputs, labels = _mask(tokens, mask_id, gen)
    return [(inputs[s * batch : (s + 1) * batch], labels[s * batch : (s + 1) * batch]) for s in range(n_steps)]


def describe(cfg: dict[str, Any]) -> str:
    """One line for the report."""
    if cfg["data"] == "synthetic":
        return "synthetic language (4 Zipf-distributed successors per token)"
    return (
        f"real text: the embedded corpus of recipes/pretrain.py ({cfg['text_chars'] / 1e6:.1f}M characters of "
        f"standard-library docstrings, {cfg['text_sequences']:,} sequences), byte-level BPE trained on it"
    )
