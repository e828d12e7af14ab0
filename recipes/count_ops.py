#!/usr/bin/env python
"""Host work per step, counted: the torch operations a training step dispatches, on every thread.

On a GPU each torch operation costs a few microseconds of host time and a kernel launch whatever its size, so a
step's overhead is its number of operations, the same on every machine. Counted here on CPU ranks (gloo), for a
model of ``N`` tiny ``Linear(8, 8)`` layers in one DDP bucket (``--biases``: ``N / 2`` layers with biases, the
weights and biases interleaved as in a transformer)::

    torchrun --standalone --nproc_per_node 2 recipes/count_ops.py --tensors 100,400 --steps 12

For each step kind of both optimizers (DDP with the hf_zeroone hook) and for DDP with ``AdamW(foreach=True)``: the
median number of top-level ``aten::`` operations (not called from inside another) per step under ``torch.profiler``
on all threads, what a step adds beyond DDP + AdamW, per tensor and per added tensor from the smallest ``N`` to the
largest; the same growth for all ``aten::`` operations, nested ones included (on the CPU a multi-tensor call runs
an operation per tensor inside, and every ``unbind`` or ``stack`` of per-tensor values a view per tensor: host work
per tensor that the top-level count does not show); and the step's time without the profiler as a ratio to DDP +
AdamW's: each step is timed against a DDP + AdamW step on its own model taken right after it, and the ratios'
median reported (still noisy: a kind that the short schedule reaches a few times has few ratios).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

#: label -> (optimizer name, keywords): short schedules that reach every step kind within the run
RUNS = {
    "1-bit Adam": ("onebit", {"freeze_step": 4}),
    "0/1 Adam": (
        "zeroone",
        dict(var_freeze_step=8, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4, exact_warmup_steps=3),
    ),
}


def _model(n: int, biases: bool = False) -> torch.nn.Module:
    """``n`` tensors of layers ``Linear(8, 8)``, orthogonal so that activations and gradients keep their norm (with
    torch's default initialisation 200 layers underflow to zero gradients, and every tensor would be masked as
    untrained). ``biases``: ``n / 2`` layers with a bias each, two shapes interleaved as in a transformer's layers."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8, bias=biases) for _ in range(n // 2 if biases else n)]
    for layer in layers:
        torch.nn.init.orthogonal_(layer.weight)
    return torch.nn.Sequential(*layers)


def _aten_counts(prof: torch.profiler.profile) -> tuple[int, int]:
    """The ``aten::`` operations of a profile: the top-level ones (not called from inside another), and all."""
    top = every = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        every += 1
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        top += parent is None
    return top, every


def _run(name: str, kwargs: dict, n: int, steps: int, profile: bool, biases: bool) -> dict[str, list]:
    """Per step kind: each step's :func:`_aten_counts` (``profile``) or its seconds against DDP + AdamW's."""
    from hf_zeroone import OneBitAdam, ZeroOneAdam, register_zeroone_hook

    def build(name: str) -> tuple[DDP, torch.optim.Optimizer]:
        ddp = DDP(_model(n, biases), bucket_cap_mb=1024)
        if name == "adamw":
            return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3, foreach=True)
        opt = (OneBitAdam if name == "onebit" else ZeroOneAdam)(ddp.parameters(), lr=1e-3, **kwargs)
        register_zeroone_hook(ddp, opt)
        return ddp, opt

    ddp, opt = build(name)
    baseline = None if profile or name == "adamw" else build("adamw")  # timed step for step beside it
    gen = torch.Generator().manual_seed(dist.get_rank())
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    out: dict[str, list] = {}
    cpu = [torch.profiler.ProfilerActivity.CPU]

    def step(x: torch.Tensor, ddp: DDP = ddp, opt: torch.optim.Optimizer = opt) -> float:
        start = time.perf_counter()
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    for i in range(steps):
        x = torch.randn(4, 8, generator=gen)
        dist.barrier()
        if profile:
            with torch.profiler.profile(activities=cpu, experimental_config=config) as prof:
                step(x)
            value = _aten_counts(prof)
        else:
            value = step(x)
            if baseline is not None:  # each step against a DDP + AdamW step taken right after it
                dist.barrier()
                value /= step(x, *baseline)
        kind = "whole step" if name == "adamw" else opt.last_step_kind.value
        if i >= 2:  # DDP rebuilds its buckets after the first iteration
            out.setdefault(kind, []).append(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", default="100,400", help="comma-separated numbers of Linear(8, 8) tensors")
    parser.add_argument("--steps", type=int, default=14, help="steps per run (every kind by 12)")
    parser.add_argument("--biases", action="store_true", help="layers with biases: N/2 weights and N/2 biases")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    sizes = [int(n) for n in args.tensors.split(",")]
    counts: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    ratios: dict[tuple[str, str], dict[int, float]] = {}
    adamw = ("DDP + AdamW(foreach=True)", "whole step")

    def medians(values: list[tuple[int, int]]) -> tuple[float, float]:
        return statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)

    for n in sizes:
        counts.setdefault(adamw, {})[n] = medians(_run("adamw", {}, n, args.steps, True, args.biases)["whole step"])
        for label, (name, kwargs) in RUNS.items():
            ops = _run(name, kwargs, n, args.steps, True, args.biases)
            times = _run(name, kwargs, n, args.steps, False, args.biases)
            for kind, values in ops.items():
                counts.setdefault((label, kind), {})[n] = medians(values)
                ratios.setdefault((label, kind), {})[n] = statistics.median(times[kind])
    if dist.get_rank() == 0:
        small, large = sizes[0], sizes[-1]
        base = counts[adamw]
        what = "N Linear(8, 8) tensors" + (" (weights and biases)" if args.biases else "")
        print(f"aten operations per step, all threads, rank 0 ({dist.get_world_size()} gloo ranks, "
              f"{what} in one DDP bucket):\n")  # fmt: skip
        print(f"| optimizer | step kind | ops at N={large} | beyond DDP + AdamW | per tensor | "
              f"growth per added tensor, N={small}..{large} | all ops' growth | "
              f"time vs DDP + AdamW, N={large} |")  # fmt: skip
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for (label, kind), by_n in counts.items():
            if large not in by_n or small not in by_n:
                continue
            extra = {n: by_n[n][0] - base[n][0] for n in (small, large)}
            growth = (extra[large] - extra[small]) / (large - small) if large > small else float("nan")
            every = {n: by_n[n][1] - base[n][1] for n in (small, large)}
            nested = (every[large] - every[small]) / (large - small) if large > small else float("nan")
            ratio = ratios.get((label, kind), {}).get(large)
            print(f"| {label} | {kind} | {by_n[large][0]:.0f} | {extra[large]:.0f} | {extra[large] / large:.1f} | "
                  f"{growth:.1f} | {nested:.1f} | {'1.00x' if ratio is None else f'{ratio:.2f}x'} |")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
