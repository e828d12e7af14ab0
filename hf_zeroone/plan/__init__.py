"""Will compression pay on a cluster? Step times projected from measurements on the local device.

``python -m hf_zeroone.plan --model bert-large --batch-size 16 --nodes 16 --gpus-per-node 4
--inter-rate 40gbit --intra-rate 2400gbit`` measures the model's forward, backward and optimizer
steps here (:mod:`._measure`), takes bytes and collectives per step from the optimizers' own
accounting for the cluster's number of ranks, and projects each method's step time on the
cluster's links (:mod:`._network`, :mod:`._project`). ``docs/planner.md`` explains the model and
its error against measured runs.

From Python, with a model of your own::

    from hf_zeroone.plan import Cluster, measure, project, parse_rate, format_table

    m = measure(model, batch, world_size=64)  # batch: model(**batch).loss is the loss
    cluster = Cluster(nodes=16, gpus_per_node=4, inter_rate=parse_rate("40gbit"), intra_rate=parse_rate("2400gbit"))
    print(format_table(m, cluster, steps=100_000))
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hf_zeroone.plan._measure import KindCost, Measurements, measure, step_kind_counts
from hf_zeroone.plan._network import Cluster, parse_latency, parse_rate
from hf_zeroone.plan._project import DILOCO_PERIODS, Projection, break_even_rate, project

__all__ = [
    "DILOCO_PERIODS",
    "PRESETS",
    "Cluster",
    "KindCost",
    "Measurements",
    "Projection",
    "break_even_rate",
    "build_model",
    "format_rate",
    "format_table",
    "measure",
    "parse_latency",
    "parse_rate",
    "project",
    "random_batch",
    "step_kind_counts",
]

#: model presets: (config class name in transformers, keyword arguments); weights are random
PRESETS: dict[str, tuple[str, dict]] = {
    "bert-tiny": ("BertConfig", {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                                 "intermediate_size": 512}),
    "bert-base": ("BertConfig", {}),
    "bert-large": ("BertConfig", {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                                  "intermediate_size": 4096}),
    "gpt2": ("GPT2Config", {}),
    "gpt2-medium": ("GPT2Config", {"n_embd": 1024, "n_layer": 24, "n_head": 16}),
    "llama-1b": ("LlamaConfig", {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 32000}),
}  # fmt: skip
_MASKED_LM = {"bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta"}


def build_model(name: str, device: torch.device | str = "cpu", **overrides: object) -> torch.nn.Module:
    """A randomly initialised language model: a preset of :data:`PRESETS`, or a ``config.json`` (or its folder).

    Offline: nothing is downloaded. Masked-LM heads for BERT-like models, causal-LM heads otherwise.
    """
    import transformers

    if name in PRESETS:
        class_name, kwargs = PRESETS[name]
        config = getattr(transformers, class_name)(**{**kwargs, **overrides})
    elif Path(name).exists():
        config = transformers.AutoConfig.from_pretrained(str(Path(name)), local_files_only=True, **overrides)
    else:
        raise ValueError(f"unknown model {name!r}: give one of {', '.join(PRESETS)} or the path of a config.json")
    torch.manual_seed(0)
    auto = transformers.AutoModelForMaskedLM if config.model_type in _MASKED_LM else transformers.AutoModelForCausalLM
    return auto.from_config(config).to(device)


def random_batch(model: torch.nn.Module, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Random token ids for ``model`` (a transformers language model), with themselves as labels."""
    config = model.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's {limit} positions")
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


def format_rate(bits_per_second: float) -> str:
    """``40 Gbit/s``-style text; ``inf`` and ``0`` as the ends of :func:`break_even_rate`'s range."""
    if math.isinf(bits_per_second):
        return "any rate"
    if bits_per_second <= 0:
        return "never"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second / 1e3:.3g} kbit/s"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def format_table(m: Measurements, cluster: Cluster, steps: int, warmup_steps: int = 0) -> str:
    """Markdown: each method's projected step, speed-ups over DDP (fp32 and bf16 gradients), its break-even rate."""
    lines = [
        "| method | sent per rank per step | step ms | speed-up vs DDP fp32 | vs DDP bf16 | "
        "faster than DDP fp32 below |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = project(m, cluster, steps, warmup_steps)
    bf16 = next(r.seconds for r in rows if r.method.startswith("DDP bf16"))
    for row in rows:
        even = "–" if row.method.startswith("DDP fp32") else format_rate(
            break_even_rate(m, cluster, row.method, steps, warmup_steps))  # fmt: skip
        lines.append(f"| {row.method} | {_bytes(row.bytes_per_step)} | {1e3 * row.seconds:.1f} | "
                     f"{row.speedup:.2f}x | {bf16 / row.seconds:.2f}x | {even} |")  # fmt: skip
    return "\n".join(lines)
