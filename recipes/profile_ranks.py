#!/usr/bin/env python
"""Where a hooked step's time goes on each rank: wall time per function, per thread, per call in the step.

The link benchmark's model (``recipes/benchmark.py``: a 5.4M-parameter ``BertForMaskedLM``, seq 128,
batch 8 per rank) under DDP, one torch thread per rank, with 1-bit Adam's or 0/1 Adam's hook, or
AdamW with a hook that sends nothing (the benchmark's no-communication reference)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 recipes/profile_ranks.py --method onebit
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 recipes/profile_ranks.py --method nocomm

Each function named in ``--functions`` (``module.function`` or ``module.Class:method``) is wrapped
in a timer for the run; its wall time is summed per thread (the training loop's ``main``, the
communicator's ``comm``). After the warm-up steps, each rank prints its forward, backward and step
medians, its CPU time per step (user + system, all threads), then a table per function: wall
milliseconds per step, the calling thread's CPU milliseconds and minor page faults per step (means),
and, for each call within a step (DDP's buckets, in the order backward reaches them), when it ended
after the step began and how long it took (medians over the steps). Wall times include waiting: a
collective's time is mostly the other rank arriving, and a thread that is not scheduled still
counts; CPU time does not, so wall minus CPU is the waiting. A page fault is a page of fresh memory
touched for the first time: glibc gives large freed blocks back to the system, so a new full-size
tensor often faults on every page it writes (about 12 ms for 20 MB here). The ranks share the
machine's cores; run nothing else beside it.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # recipes/ is not a package; bench/ is
from bench.measure import local_only_hook  # noqa: E402
from bench.workload import build_model  # noqa: E402

#: the benchmark's model (``recipes/benchmark.py``'s defaults)
MODEL = dict(vocab=8192, hidden=256, layers=4, heads=4, intermediate=1024, seq_len=128, seed=0)

DEFAULT_FUNCTIONS = (
    "hf_zeroone.ddp_hook.zeroone_hook",
    "hf_zeroone.optim._messages.Messages:write",
    "hf_zeroone.optim._messages.Messages:finish",
    "hf_zeroone._two_stage.compressed_allreduce",
    "hf_zeroone._executor._Collectives:all_to_all",
    "hf_zeroone._executor._Collectives:all_gather",
    "hf_zeroone.optim.onebit_adam.OneBitAdam:step",
    "hf_zeroone.optim.zeroone_adam.ZeroOneAdam:step",
    "torch.optim.adamw.AdamW:step",
)


#: ``getrusage`` of the calling thread (Linux); elsewhere the page-fault column reads 0
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)


def _thread_faults() -> int:
    return 0 if _RUSAGE_THREAD is None else resource.getrusage(_RUSAGE_THREAD).ru_minflt


class Timers:
    """Wall time, thread CPU time and page faults of wrapped functions per (function, thread); each call's end."""

    def __init__(self) -> None:
        self.step_start = 0.0
        #: per (function, thread): (step, end within the step, wall, thread CPU, minor page faults) of each call
        self.calls: dict[tuple[str, str], list[tuple[int, float, float, float, int]]] = collections.defaultdict(list)
        self.step = -1

    def wrap(self, target: str) -> None:
        module_name, _, name = target.rpartition(".")
        if not module_name:
            raise SystemExit(f"--functions: {target!r} is not module.function or module.Class:method")
        owner: Any = importlib.import_module(module_name)
        if ":" in name:
            cls, name = name.split(":", 1)
            owner = getattr(owner, cls)
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            start, cpu, faults = time.perf_counter(), time.thread_time(), _thread_faults()
            try:
                return original(*args, **kwargs)
            finally:
                end = time.perf_counter()
                cpu, faults = time.thread_time() - cpu, _thread_faults() - faults
                thread = "main" if threading.current_thread() is threading.main_thread() else "comm"
                self.calls[(target, thread)].append((self.step, end - self.step_start, end - start, cpu, faults))

        setattr(owner, name, timed)
        if not isinstance(owner, type):  # modules that imported the function by name
            for module in list(sys.modules.values()):
                if module is not owner and getattr(module, name, None) is original:
                    setattr(module, name, timed)

    def report(self, first: int, steps: int) -> list[str]:
        lines = [
            "| function | thread | ms/step | CPU ms/step | page faults/step | call: ends at ms, takes ms (medians) |",
            "|---|---|---:|---:|---:|---|",
        ]
        rows = []
        for (target, thread), calls in self.calls.items():
            calls = [c for c in calls if c[0] >= first]
            if not calls:
                continue
            per_step = collections.defaultdict(list)
            for step, end, took, _, _ in calls:
                per_step[step].append((end, took))
            # calls per step where it ran: a callback runs on whichever thread completes its future,
            # so a function may run on a thread in only some steps (medians over those steps)
            n_calls = max(len(c) for c in per_step.values())
            parts = []
            for k in range(n_calls):
                kth = [c[k] for c in per_step.values() if len(c) > k]
                ends, takes = statistics.median(e for e, _ in kth), statistics.median(t for _, t in kth)
                parts.append(f"{k}: {ends * 1e3:.1f}, {takes * 1e3:.2f}")
            total = sum(c[2] for c in calls) / steps
            cpu, faults = sum(c[3] for c in calls) / steps, sum(c[4] for c in calls) / steps
            row = f"| {target} | {thread} | {total * 1e3:.2f} | {cpu * 1e3:.2f} | {faults:.0f} | {'; '.join(parts)} |"
            rows.append((total, row))
        return lines + [row for _, row in sorted(rows, reverse=True)]


def _optimizer(method: str, params: Any, ddp: torch.nn.Module) -> torch.optim.Optimizer:  # noqa: ANN401
    """The benchmark's optimizer of ``method``, with its hook registered on ``ddp``."""
    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    if method == "nocomm":
        ddp.register_comm_hook(None, local_only_hook)
        return torch.optim.AdamW(params, lr=1e-3)
    if method == "onebit":
        opt = OneBitAdam(params, lr=1e-3, freeze_step=3)
    else:  # the local phase from step 8 on
        opt = ZeroOneAdam(
            params, lr=1e-3, var_freeze_step=8, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4,
            exact_warmup_steps=4,
        )  # fmt: skip
    register_zeroone_hook(ddp, opt)
    return opt


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=("onebit", "zeroone", "nocomm"), default="onebit")
    parser.add_argument("--steps", type=int, default=30, help="steps in all")
    parser.add_argument("--skip", type=int, default=8, help="first steps left out (warm-up, the buckets' rebuild)")
    parser.add_argument(
        "--functions", default=",".join(DEFAULT_FUNCTIONS), help="comma-separated module.function, module.Class:method"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.skip < args.steps:
        parser.error(f"--skip must leave steps to time: 0 <= skip < steps, got {args.skip} and {args.steps}")
    if "RANK" not in os.environ:
        parser.error("start it with torchrun, e.g. torchrun --standalone --nproc_per_node 2 recipes/profile_ranks.py")
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    timers = Timers()
    for target in filter(None, (t.strip() for t in args.functions.split(","))):
        try:
            timers.wrap(target)
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"--functions: cannot wrap {target!r}: {e}") from e
    model = build_model(MODEL)
    ddp = DistributedDataParallel(model)
    opt = _optimizer(args.method, ddp.parameters(), ddp)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, MODEL["vocab"], (8, MODEL["seq_len"]), generator=gen) for _ in range(args.steps)]
    phases: dict[str, list[float]] = collections.defaultdict(list)
    clock: Callable[[], float] = time.perf_counter

    def cpu() -> float:
        use = resource.getrusage(resource.RUSAGE_SELF)
        return use.ru_utime + use.ru_stime

    for step, ids in enumerate(batches):
        dist.barrier()
        timers.step, c0 = step, cpu()
        t0 = timers.step_start = clock()
        loss = ddp(input_ids=ids, labels=ids).loss
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = clock()
        if step >= args.skip:
            for name, value in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2), ("total", t3 - t0)):
                phases[name].append(value)
            phases["cpu"].append(cpu() - c0)
    timed = args.steps - args.skip
    summary = ", ".join(f"{name} {statistics.median(v) * 1e3:.1f}" for name, v in phases.items())
    lines = [f"rank {rank}, {args.method}, {timed} steps after {args.skip}: ms per step (medians): {summary}", ""]
    lines += timers.report(args.skip, timed)
    for r in range(dist.get_world_size()):
        if r == rank:
            print("\n".join(lines) + "\n", flush=True)
        dist.barrier()
    if hasattr(opt, "comm"):
        opt.comm.close()
    dist.destroy_process_group()
    return lines


if __name__ == "__main__":
    main()
