#!/usr/bin/env python
"""The optimizer step alone, against ``torch.optim.AdamW(foreach=True)``, in every phase of both optimizers.

One process, on a model with many tensors, where per-tensor Python loops and kernel launches show; each phase timed
on an optimizer of its own whose timed steps are all of that kind::

    python recipes/bench_step.py                       # CPU, a 24-layer BERT of width 64 (400+ tensors)
    python recipes/bench_step.py --device cuda --fused # on a GPU, also against AdamW(fused=True)
    python recipes/bench_step.py --loopback 2          # with the message maths of 2 simulated ranks

Alone in its process an optimizer communicates nothing; ``--loopback P`` gives it a communicator that stands in for
P ranks (``Communicator._loopback``): the whole compressed exchange, with local copies in place of the network.
Prints the median milliseconds per step, the ratio to AdamW and the range of that ratio over the rounds: compare
ratios inside one run (a difference smaller than the range is noise).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from hf_zeroone import OneBitAdam, ZeroOneAdam
from hf_zeroone.comm import Communicator

#: phase -> (optimizer class, constructor keywords, steps taken before timing starts); each phase's
#: timed steps are all of that kind
PHASES = {
    "1-bit Adam: warm-up (exact)": (OneBitAdam, {"freeze_step": 10**9}, 2),
    "1-bit Adam: 1-bit momentum": (OneBitAdam, {"freeze_step": 2}, 4),
    "0/1 Adam: 1-bit gradient": (
        ZeroOneAdam,
        {"var_freeze_step": 10**9, "var_update_scaler": 1, "exact_warmup_steps": 0},
        40,  # variance updates at steps 1, 3, 7, ..., 63: none among the timed ones
    ),
    "0/1 Adam: local step": (
        ZeroOneAdam,
        {"var_freeze_step": 2, "local_step_scaler": 1, "local_step_clipper": 1 << 20, "exact_warmup_steps": 0},
        70,  # syncs 1, 2, 4, ..., 64 steps apart: none among the timed ones
    ),
    "0/1 Adam: sync": (ZeroOneAdam, {"var_freeze_step": 2, "local_step_clipper": 1, "exact_warmup_steps": 0}, 4),
}


def build_model(layers: int, width: int) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=1024, hidden_size=width, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=4 * width, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    return BertForMaskedLM(config)


def time_steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], before: int, timed: int) -> list[float]:
    """Seconds of ``timed`` steps after ``before`` untimed ones; fresh random gradients each step.

    Raises if the timed steps of a hf_zeroone optimizer are not all of one kind, or one was skipped.
    """
    gen = torch.Generator(device=params[0].device).manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen, device=p.device) * 1e-3 for p in params]
    out, kinds = [], set()
    ours = hasattr(opt, "schedule")  # a hf_zeroone optimizer: its steps are counted, and can be skipped
    for i in range(before + timed):
        for p, g in zip(params, grads):
            p.grad = g.mul(1.0 + 0.01 * (i % 7))
        if params[0].is_cuda:
            torch.cuda.synchronize()
        applied = opt.schedule["step"] if ours else 0
        start = time.perf_counter()
        opt.step()
        if params[0].is_cuda:
            torch.cuda.synchronize()
        if i >= before:
            out.append(time.perf_counter() - start)
            if ours and opt.schedule["step"] != applied + 1:
                raise RuntimeError(f"{type(opt).__name__}: a timed step was skipped (non-finite): it times less work")
            kinds.add(getattr(opt, "last_step_kind", None))
    if len(kinds) != 1:
        raise RuntimeError(f"{type(opt).__name__}: the timed steps mix kinds {kinds}; adjust PHASES")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per phase")
    parser.add_argument("--rounds", type=int, default=3, help="AdamW and each phase, alternating, this many times")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fused", action="store_true", help="also time AdamW(fused=True) (CUDA)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument(
        "--loopback", type=int, default=0, metavar="P",
        help="run the compressed exchange of P simulated ranks in this process (0: communicate nothing)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.loopback == 1 or args.loopback < 0:
        raise SystemExit(f"--loopback {args.loopback}: give 2 or more simulated ranks, or 0 for none")
    if args.loopback:
        warnings.filterwarnings("ignore", message=".*communicates in step.. because no hf_zeroone DDP hook ran")
    model = build_model(args.layers, args.width).to(args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    ranks = f", {args.loopback} simulated ranks (loopback: the message maths, no network)" if args.loopback else ""
    print(f"{len(params)} tensors, {numel:,} parameters, device {args.device}, {args.threads} thread(s){ranks}\n")
    baselines = {"AdamW(foreach=True)": lambda: torch.optim.AdamW(params, lr=1e-3, foreach=True)}
    if args.fused:
        baselines["AdamW(fused=True)"] = lambda: torch.optim.AdamW(params, lr=1e-3, fused=True)
    rounds: list[dict[str, list[float]]] = []
    for _ in range(args.rounds):  # interleaved, so a noisy stretch of the machine hits every row
        timings: dict[str, list[float]] = {}
        for name, make in baselines.items():
            timings[name] = time_steps(make(), params, 2, args.steps)
        for name, (cls, kw, before) in PHASES.items():
            comm = Communicator._loopback(args.loopback, threaded=True) if args.loopback else None
            timings[name] = time_steps(cls(params, lr=1e-3, communicator=comm, **kw), params, before, args.steps)
            if comm is not None:
                comm.close()
        rounds.append(timings)
    print(table(rounds))


def table(rounds: list[dict[str, list[float]]]) -> str:
    """Markdown: each row's median over all rounds, its ratio to AdamW, and the range of the per-round ratios
    (the machine's noise: a difference between two rows smaller than it is not a measurement)."""
    base = "AdamW(foreach=True)"
    lines = [f"| step | median ms | vs {base} | per-round range |", "|---|---:|---:|---:|"]
    reference = statistics.median([t for r in rounds for t in r[base]])
    for name in rounds[0]:
        median = statistics.median([t for r in rounds for t in r[name]])
        per_round = [statistics.median(r[name]) / statistics.median(r[base]) for r in rounds]
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}x"
        lines.append(f"| {name} | {1e3 * median:.2f} | {median / reference:.2f}x | {spread} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
