#!/usr/bin/env python
"""Pre-train a small BERT (masked LM) or GPT-2 (causal LM) with AdamW, 1-bit Adam or 0/1 Adam.

A custom Accelerate training loop using the hf_zeroone plugin (``prepare_zeroone``), on a model built from a config
(no weights to download). Data: a ``datasets`` text dataset (``--dataset_name``), local text files (``--train_file``)
or, by default, the docstrings of this Python's standard library, parsed with ``ast`` (nothing imported or
downloaded, nothing stored here); a byte-level BPE tokenizer is trained on them unless ``--tokenizer_name`` is given.

Two CPU processes, offline, a few minutes::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/pretrain.py

GPT-2 style with 1-bit Adam::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/pretrain.py \\
        --objective clm --optimizer onebit_adam

It prints a progress bar, then the loss and the bytes this rank sent against an fp32 allreduce
of the same gradients, and writes ``log.jsonl`` and ``summary.json`` to ``--output_dir``.
"""

from __future__ import annotations

import ast
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


def arg(default: Any, help: str) -> Any:  # noqa: ANN401
    """A dataclass field with its command-line help."""
    return field(default=default, metadata={"help": help})


@dataclass
class PretrainArguments:
    objective: str = arg("mlm", "mlm (BERT-style) or clm (GPT-2-style).")
    optimizer: str = arg("zeroone_adam", "adamw_torch, onebit_adam or zeroone_adam.")
    dataset_name: str | None = arg(None, "A datasets text dataset (hub or local).")
    dataset_config_name: str | None = arg(None, "Its configuration name.")
    text_column: str = arg("text", "Column holding the text.")
    train_file: str | None = arg(None, "Local .txt file(s), comma-separated.")
    tokenizer_name: str | None = arg(None, "Tokenizer path or id; default: a BPE trained on the corpus.")
    max_corpus_chars: int = arg(3_000_000, "Size of the embedded corpus.")
    vocab_size: int = arg(4096, "Vocabulary of the trained tokenizer.")
    hidden_size: int = arg(128, "Model width.")
    num_layers: int = arg(2, "Transformer layers.")
    num_heads: int = arg(2, "Attention heads.")
    seq_len: int = arg(64, "Tokens per training sequence.")
    batch_size: int = arg(16, "Sequences per process and step.")
    max_steps: int = arg(300, "Optimizer steps.")
    learning_rate: float = arg(1e-3, "Peak learning rate.")
    warmup_steps: int = arg(30, "Linear LR warm-up steps.")
    weight_decay: float = arg(0.01, "Decoupled weight decay.")
    max_grad_norm: float = arg(1.0, "Gradient clipping (0 = off).")
    freeze_step: int | None = arg(None, "1-bit Adam exact steps (default: recommended_freeze_step, warm-up W).")
    var_freeze_step: int | None = arg(None, "0/1 Adam variance freeze (default: recommended_freeze_step, 2 W).")
    var_update_scaler: int = arg(16, "0/1 Adam kappa.")
    local_step_scaler: int | None = arg(None, "0/1 Adam sync-gap doubling period (default: recommended_local_steps).")
    local_step_clipper: int | None = arg(None, "0/1 Adam largest sync gap (default: 16, at most 1/64 of phase 2).")
    exact_warmup_steps: int | None = arg(None, "0/1 Adam exact steps at the start (default: all of phase 1).")
    eval_sequences: int = arg(64, "Held-out sequences for the final loss.")
    log_every: int = arg(10, "Steps between log lines.")
    seed: int = arg(0, "Seed for model init and data order.")
    output_dir: str = arg("outputs/pretrain", "Logs, summary, tokenizer cache.")

    def __post_init__(self) -> None:
        if self.objective not in ("mlm", "clm"):
            raise ValueError(f"--objective must be mlm or clm, got {self.objective!r}")
        if self.optimizer not in ("adamw_torch", "onebit_adam", "zeroone_adam"):
            raise ValueError(f"--optimizer must be adamw_torch, onebit_adam or zeroone_adam, got {self.optimizer!r}")
        if self.max_steps < 1 or self.seq_len < 8 or self.batch_size < 1:
            raise ValueError("--max_steps, --batch_size must be >= 1 and --seq_len >= 8")


# ----------------------------------------------------------------------------------- data
def file_docstrings(path: Path, min_chars: int) -> list[str]:
    """Docstrings of a source file's module, classes and functions (parsed, never imported).

    Only those of at least ``min_chars`` characters; none if the file cannot be read or parsed.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return [doc for doc in docs if doc and len(doc) >= min_chars]


def embedded_corpus(max_chars: int) -> list[str]:
    """Docstrings of the standard library's modules, classes and functions (read, not imported)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if any(part in ("test", "tests", "idle_test", "site-packages") for part in path.parts):
            continue
        for doc in file_docstrings(path, 81):
            texts.append(" ".join(doc.split()))
            total += len(texts[-1])
        if total >= max_chars:
            break
    if not texts:
        raise RuntimeError(f"no docstrings found under {root}; pass --train_file or --dataset_name")
    return texts


def load_texts(args: PretrainArguments) -> list[str]:
    if args.train_file:
        texts = []
        for name in args.train_file.split(","):
            texts.extend(line.strip() for line in Path(name).read_text(encoding="utf-8").splitlines() if line.strip())
        return texts
    if args.dataset_name:
        import datasets

        ds = datasets.load_dataset(args.dataset_name, args.dataset_config_name, split="train")
        return [t for t in ds[args.text_column] if t and t.strip()]
    return embedded_corpus(args.max_corpus_chars)


def build_tokenizer(args: PretrainArguments, texts: list[str], cache: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if args.tokenizer_name:
        return AutoTokenizer.from_pretrained(args.tokenizer_name)
    if (cache / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(cache))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    roles = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    roles.update(bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    specials = list(dict.fromkeys(roles.values()))  # the first token ids, in this order
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **roles)
    fast.save_pretrained(str(cache))
    return fast


def make_blocks(tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate the tokenised texts (separated by EOS) and cut them into fixed-length blocks."""
    ids: list[int] = []
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    for start in range(0, len(texts), 1000):
        for row in tokenizer(texts[start : start + 1000], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            if sep is not None:
                ids.append(sep)
    n = len(ids) // seq_len
    if n < 2:
        raise ValueError(f"the corpus gives {n} sequences of {seq_len} tokens; give more text or a shorter --seq_len")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


# ----------------------------------------------------------------------------------- model
def build_model(args: PretrainArguments, tokenizer):
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    vocab = len(tokenizer)
    if args.objective == "mlm":
        config = BertConfig(
            vocab_size=vocab,
            hidden_size=args.hidden_size,
            num_hidden_layers=args.num_layers,
            num_attention_heads=args.num_heads,
            intermediate_size=4 * args.hidden_size,
            max_position_embeddings=max(512, args.seq_len),
            pad_token_id=tokenizer.pad_token_id,
        )
        return BertForMaskedLM(config)
    config = GPT2Config(
        vocab_size=vocab,
        n_embd=args.hidden_size,
        n_layer=args.num_layers,
        n_head=args.num_heads,
        n_positions=max(512, args.seq_len),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return GPT2LMHeadModel(config)


def build_optimizer(args: PretrainArguments, model: torch.nn.Module) -> torch.optim.Optimizer:
    from hf_zeroone import OneBitAdam, ZeroOneAdam, recommended_freeze_step, recommended_local_steps

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    warm = max(1, args.warmup_steps)
    if args.optimizer == "onebit_adam":
        freeze = args.freeze_step or recommended_freeze_step(args.max_steps, warm)
        return OneBitAdam(groups, lr=args.learning_rate, freeze_step=freeze)
    if args.optimizer == "zeroone_adam":
        var_freeze = args.var_freeze_step
        if var_freeze is None:
            var_freeze = recommended_freeze_step(args.max_steps, 2 * warm)
        local = recommended_local_steps(args.max_steps, var_freeze, args.local_step_clipper)
        if args.local_step_scaler is not None:
            local["local_step_scaler"] = args.local_step_scaler
        return ZeroOneAdam(
            groups,
            lr=args.learning_rate,
            var_freeze_step=var_freeze,
            var_update_scaler=args.var_update_scaler,
            exact_warmup_steps=args.exact_warmup_steps,
            **local,
        )
    return torch.optim.AdamW(groups, lr=args.learning_rate)


# ----------------------------------------------------------------------------------- training
def main(argv: list[str] | None = None) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import DataCollatorForLanguageModeling, HfArgumentParser, get_linear_schedule_with_warmup

    from hf_zeroone.comm import fp32_allreduce_bytes
    from hf_zeroone.integrations import prepare_zeroone
    from hf_zeroone.integrations.launch import check_distributed_launch

    argv = sys.argv[1:] if argv is None else argv
    parser = HfArgumentParser(PretrainArguments)
    if len(argv) == 1 and argv[0].endswith(".json"):
        (args,) = parser.parse_json_file(os.path.abspath(argv[0]))
    else:
        (args,) = parser.parse_args_into_dataclasses(argv)

    accelerator = Accelerator()
    check_distributed_launch("pretrain.py")
    world = accelerator.num_processes
    set_seed(args.seed)
    out = Path(args.output_dir)
    cache = out / "tokenizer"
    with accelerator.main_process_first():
        texts = load_texts(args)
        tokenizer = build_tokenizer(args, texts, cache)
        blocks = make_blocks(tokenizer, texts, args.seq_len)
    g = torch.Generator().manual_seed(args.seed)
    blocks = blocks[torch.randperm(len(blocks), generator=g)]
    n_eval = min(args.eval_sequences, len(blocks) // 10)
    eval_blocks, train_blocks = blocks[:n_eval], blocks[n_eval:]

    collator = DataCollatorForLanguageModeling(tokenizer, mlm=args.objective == "mlm", mlm_probability=0.15)
    train_ds = [{"input_ids": b} for b in train_blocks]
    loader = torch.utils.data.DataLoader(
        train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collator, drop_last=True, generator=g
    )
    model = build_model(args, tokenizer)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = build_optimizer(args, model)
    # Accelerate steps a prepared scheduler once per process for every optimizer step: count in those steps
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps * world, args.max_steps * world)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    compressed = args.optimizer != "adamw_torch"
    hook_state = prepare_zeroone(accelerator, model, optimizer) if compressed else None
    inner = optimizer.optimizer

    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        print(
            f"{args.objective.upper()} {type(accelerator.unwrap_model(model)).__name__}, {numel:,} parameters, "
            f"{len(train_ds):,} training sequences of {args.seq_len} tokens, {world} process(es), "
            f"optimizer {type(inner).__name__}, hook {'on' if hook_state else 'off'}",
            flush=True,
        )
    log_rows = []
    fp32_step = fp32_allreduce_bytes(numel, world)
    step, start = 0, time.perf_counter()
    bar = tqdm(total=args.max_steps, disable=not accelerator.is_main_process, desc=args.optimizer)
    model.train()
    while step < args.max_steps:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            if args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            sent = inner.comm_stats.bytes_sent if compressed else fp32_step * step
            kind = inner.last_step_kind.value if compressed else "exact"
            log_rows.append(
                {
                    "step": step,
                    "loss": loss.item(),
                    "lr": scheduler.get_last_lr()[0],
                    "kind": kind,
                    "bytes_total": sent,
                    "fp32_bytes_total": fp32_step * step,
                    "collectives_total": inner.comm_stats.collectives if compressed else step,
                    "wall": time.perf_counter() - start,
                }
            )
            if step % args.log_every == 0:
                recent = sum(r["loss"] for r in log_rows[-args.log_every :]) / args.log_every
                bar.set_postfix(loss=f"{recent:.3f}", kind=kind, MB=f"{sent / 1e6:.1f}")
            bar.update(1)
            if step >= args.max_steps:
                break
    bar.close()
    wall = time.perf_counter() - start

    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    torch.manual_seed(args.seed + 1)  # the same masking on every rank and every run
    with torch.no_grad():
        eval_batches = [collator([{"input_ids": b} for b in eval_blocks[i : i + 16]]) for i in range(0, n_eval, 16)]
        eval_loss = sum(float(unwrapped(**b).loss) for b in eval_batches) / max(1, len(eval_batches))
    tail = log_rows[-min(20, len(log_rows)) :]
    summary = {
        "args": asdict(args),
        "world_size": world,
        "parameters": numel,
        "train_loss_last20": sum(r["loss"] for r in tail) / len(tail),
        "eval_loss": eval_loss,
        "eval_perplexity": math.exp(min(eval_loss, 50)),
        "bytes_sent_per_rank": log_rows[-1]["bytes_total"],
        "fp32_bytes_per_rank": fp32_step * step,
        "collectives": log_rows[-1]["collectives_total"],
        "wall_seconds": wall,
        "bytes_counted_by": "hf_zeroone CommStats" if compressed else "fp32 ring-allreduce formula (plain DDP)",
    }
    if accelerator.is_main_process:
        with open(out / "log.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in log_rows)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        ratio = summary["fp32_bytes_per_rank"] / max(1, summary["bytes_sent_per_rank"])
        print(
            f"\nfinished {step} steps in {wall:.0f}s: train loss (last 20) {summary['train_loss_last20']:.3f}, "
            f"held-out loss {eval_loss:.3f}\n"
            f"bytes sent by rank 0: {summary['bytes_sent_per_rank'] / 1e6:.2f} MB vs "
            f"{summary['fp32_bytes_per_rank'] / 1e6:.2f} MB for fp32 allreduce of every gradient "
            f"(1/{ratio:.1f}), {summary['collectives']} collectives\n"
            f"log: {out / 'log.jsonl'}, summary: {out / 'summary.json'}",
            flush=True,
        )
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
