"""Bytes per parameter each optimizer holds, per phase: 1-bit Adam and 0/1 Adam against AdamW and DeepSpeed.

    python recipes/bench_memory.py   # Linux, CPU, its own gloo ranks: under a minute on two cores

``--world_size`` ranks train a stack of Linear layers (about 3.1M fp32 parameters) through every phase with AdamW
(plain DDP) and with ``OneBitAdam`` and ``ZeroOneAdam``, on DDP with the hf_zeroone hook and on ``step()``.
*Held*: the largest, over a phase's steps, of the tensor storage the optimizer holds after a step
(:func:`hf_zeroone.optim.state_bytes`), per parameter; the model and its gradients are not included.
*Transient*: the peak resident size during backward + step (``VmHWM``; large allocations go straight to and
from the OS) above the larger of the resident sizes before and after. docs/memory.md explains the figures.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_zeroone import OneBitAdam, StepKind, ZeroOneAdam
from hf_zeroone.ddp_hook import register_zeroone_hook
from hf_zeroone.optim import documented_bytes_per_param, state_bytes

#: DeepSpeed's per-parameter optimizer state in bytes, by phase, for P ranks, as ``deepspeed/runtime/fp16/onebit/
#: {adam,zoadam}.py`` allocates it (not counted: its fp16 engine's fp32 master weights, any optimizer's cost)
DEEPSPEED: dict[str, dict[str, Callable[[int], float]]] = {
    "AdamW": {"all phases": lambda P: 8.0},
    # exp_avg and exp_avg_sq, then worker_error (padded size) and server_error (padded size / P) once compressing
    "OneBitAdam": {"warm-up (exact)": lambda P: 8.0, "compression (1-bit momentum)": lambda P: 12.0 + 4.0 / P},
    # both moments, both error buffers and momentum_accumulator, all allocated at the first step and kept
    "ZeroOneAdam": dict.fromkeys(
        ("phase 1, exact steps only", "phase 1 (1-bit gradients)", "phase 2 (local steps, 1-bit syncs)"),
        lambda P: 16.0 + 4.0 / P,
    ),
}
STEPS = {"AdamW": 4, "OneBitAdam": 8, "ZeroOneAdam": 18}


def make_model(width: int, layers: int, embedding: int = 0) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = [torch.nn.Embedding(embedding, width // 2)] if embedding else []
    mods += [torch.nn.Linear(width // 2, width), torch.nn.Tanh()]
    for _ in range(layers - 2):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    mods.append(torch.nn.Linear(width, width // 2))
    return torch.nn.Sequential(*mods)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "OneBitAdam":
        return OneBitAdam(params, lr=1e-3, weight_decay=0.01, freeze_step=3)
    # exact steps 0-1, then T_v (1-bit gradients on 3, 5, 6), local steps and syncs from step 8
    return ZeroOneAdam(
        params,
        lr=1e-3,
        weight_decay=0.01,
        var_freeze_step=8,
        var_update_scaler=1,
        local_step_scaler=2,
        local_step_clipper=4,
        exact_warmup_steps=2,
    )


def phase_of(name: str, kind: StepKind | None, compressed_before: bool) -> str:
    if name == "AdamW":
        return "all phases"
    if name == "OneBitAdam":
        return "warm-up (exact)" if kind is StepKind.EXACT else "compression (1-bit momentum)"
    if kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC):
        return "phase 2 (local steps, 1-bit syncs)"
    return "phase 1 (1-bit gradients)" if compressed_before else "phase 1, exact steps only"


def resident_bytes() -> tuple[int, int]:
    """This process's resident set size and its high-water mark since :func:`reset_peak`, in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size (Linux)


Phases = dict[str, tuple[float, dict[str, float], float, float]]


def run(name: str, path: str, args: argparse.Namespace, rank: int) -> Phases:
    """Train one optimizer on one path. Per phase, in bytes per parameter: the largest held after a step
    and its breakdown, the largest transient peak of a backward + step, and the largest growth of the
    resident size after a step over the resident size before the first step (gradients allocated)."""
    model = make_model(args.width, args.layers, args.embedding)
    n = sum(p.numel() for p in model.parameters())
    wrapped = DDP(model, bucket_cap_mb=args.bucket_mb) if path == "hook" else model
    opt = make_optimizer(name, wrapped.parameters())
    if name != "AdamW":
        opt.step_bucket_numel = int(args.bucket_mb * 2**20) // 4
    if path == "hook" and name != "AdamW":
        register_zeroone_hook(wrapped, opt)
    gen = torch.Generator().manual_seed(1000 + rank)
    phases: Phases = {}
    compressed, base = False, None
    for _ in range(STEPS[name]):
        if args.embedding:  # only the first quarter of the rows is ever used: the rest is masked
            x = torch.randint(0, args.embedding // 4, (8,), generator=gen)
            loss = wrapped(x).pow(2).mean()
        else:
            x = torch.randn(8, args.width // 2, generator=gen)
            loss = (wrapped(x) - x.flip(1)).pow(2).mean()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: not part of the transient
        reset_peak()
        before, _ = resident_bytes()
        loss.backward()
        if base is None:
            base, _ = resident_bytes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the step() path's "no hook ran" warning
            opt.step()
        time.sleep(0.05)  # the communication thread lets go of a finished job
        after, peak = resident_bytes()
        transient = max(0, peak - max(before, after)) / n
        kind = getattr(opt, "last_step_kind", None)
        compressed = compressed or (kind is not None and kind.compressed)
        roles = {role: b / n for role, b in state_bytes(opt).items()}
        phase = phase_of(name, kind, compressed)
        held, held_roles, worst, grown = phases.get(phase, (-1.0, {}, 0.0, 0.0))
        if sum(roles.values()) >= held:
            held, held_roles = sum(roles.values()), roles
        phases[phase] = (held, held_roles, max(worst, transient), max(grown, (after - base) / n))
    if name != "AdamW":
        opt.comm.close()
    return phases


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    results = {}
    for name in ("AdamW", "OneBitAdam", "ZeroOneAdam"):
        for path in ("hook", "step"):
            if name == "AdamW" and path == "step":
                continue
            results[(name, path)] = run(name, path, args, rank)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def report(results: dict, world: int, n: int, breakdown: bool) -> str:
    lines = [
        f"Bytes per parameter held by the optimizer between steps, beyond the model and its gradients "
        f"(fp32, {n / 1e6:.1f}M parameters, {world} ranks):",
        "",
        "| optimizer | phase | DDP + hf_zeroone hook | `step()` path | documented | DeepSpeed |",
        "|---|---|---:|---:|---:|---:|",
    ]
    peaks: list[str] = []
    for name, phases in DEEPSPEED.items():
        for phase, ds in phases.items():
            hook = results[(name, "hook")].get(phase)
            step = results.get((name, "step"), {}).get(phase)
            cells = [fmt(c[0]) if c else "-" for c in (hook, step)]
            measured = [f"{c[2]:.1f}" if c else "-" for c in (hook, step)] + [f"{step[3]:.1f}" if step else "-"]
            peaks.append(f"| {name} | {phase} | " + " | ".join(measured) + " |")
            if name == "AdamW":
                cells[1] = "(plain DDP)"
            doc = fmt(documented_bytes_per_param(name, phase, world))
            label = "AdamW (torch)" if name == "AdamW" else name
            lines.append(f"| {label} | {phase} | {cells[0]} | {cells[1]} | {doc} | {fmt(ds(world))} |")
    lines += [
        "",
        "Measured on the process (bytes per parameter): transient peak during backward + step above the "
        "larger of the resident sizes before and after (VmHWM); growth of the resident size after a step "
        "over that before the first step (VmRSS, gradients allocated), a cross-check of the held figures "
        "where DDP's own buffers do not move it:",
        "",
        "| optimizer | phase | transient, hook | transient, `step()` | resident growth, `step()` |",
        "|---|---|---:|---:|---:|",
        *peaks,
    ]
    if breakdown:
        lines += ["", "By role (bytes per parameter):", "", "| optimizer | path | phase | roles |", "|---|---|---|---|"]
        for (name, path), phases in results.items():
            for phase, (_, roles, _, _) in phases.items():
                listed = ", ".join(f"{r} {fmt(b)}" for r, b in roles.items() if b >= 0.005)
                lines.append(f"| {name} | {path} | {phase} | {listed} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world_size", type=int, default=2, help="gloo ranks to spawn (default 2)")
    parser.add_argument("--width", type=int, default=1024, help="width of the hidden layers (default 1024)")
    parser.add_argument("--layers", type=int, default=4, help="number of Linear layers (default 4)")
    parser.add_argument("--bucket_mb", type=float, default=25.0, help="DDP's and step()'s bucket, MiB (default 25)")
    parser.add_argument("--embedding", type=int, default=0, help="an embedding of N rows first, 3/4 of them unused")
    parser.add_argument("--breakdown", action="store_true", help="also print the bytes per role")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # large allocations straight from the OS and back on free, so that VmHWM sees every transient
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.world_size, port, args, queue)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    results = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    n = sum(p.numel() for p in make_model(args.width, args.layers, args.embedding).parameters())
    print(report(results, args.world_size, n, args.breakdown))


if __name__ == "__main__":
    main()
