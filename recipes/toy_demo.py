"""Two-process CPU demo: AdamW vs 1-bit Adam vs 0/1 Adam on a small regression model.

Run (offline, CPU, two processes)::

    torchrun --standalone --nproc_per_node 2 recipes/toy_demo.py

Each rank trains the same MLP on its own data stream with plain DDP (AdamW) and with the
hf_zeroone DDP hook (OneBitAdam, ZeroOneAdam), then rank 0 prints a table: held-out loss, bytes
this rank sent (the package's own count) against an fp32 allreduce of the same gradients, and
the number of collectives.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_zeroone import OneBitAdam, ZeroOneAdam
from hf_zeroone.comm import fp32_allreduce_bytes
from hf_zeroone.ddp_hook import register_zeroone_hook


def make_model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, 1),
    )


def batch(gen: torch.Generator, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, 32, generator=gen)
    w = torch.linspace(-1, 1, 32)
    return x, torch.sin(x @ w).unsqueeze(1) + 0.5 * x[:, :1] * x[:, 1:2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    if "RANK" not in os.environ:
        raise SystemExit(
            "toy_demo.py needs several processes: run it with\n"
            "    torchrun --standalone --nproc_per_node 2 recipes/toy_demo.py"
        )
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    warm = args.steps // 10
    methods = {
        "AdamW (DDP, fp32 allreduce)": lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.01),
        "1-bit Adam + hook": lambda p: OneBitAdam(p, lr=args.lr, weight_decay=0.01, freeze_step=warm),
        "0/1 Adam + hook": lambda p: ZeroOneAdam(
            p,
            lr=args.lr,
            weight_decay=0.01,
            var_freeze_step=args.steps // 3,
            var_update_scaler=4,
            local_step_scaler=max(1, args.steps // 20),
            local_step_clipper=8,
            exact_warmup_steps=warm,
        ),
    }
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        tqdm = None
    rows = []
    for name, make_opt in methods.items():
        model = make_model(args.hidden)
        ddp = DDP(model)
        opt = make_opt(ddp.parameters())
        hooked = not isinstance(opt, torch.optim.AdamW)
        if hooked:
            register_zeroone_hook(ddp, opt)
        gen = torch.Generator().manual_seed(1000 + rank)
        steps = range(args.steps)
        if rank == 0 and tqdm is not None:
            steps = tqdm(steps, desc=name, leave=False)
        start = time.perf_counter()
        for _ in steps:
            x, y = batch(gen)
            opt.zero_grad()
            loss = ((ddp(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
        elapsed = time.perf_counter() - start
        held = torch.Generator().manual_seed(424242)
        with torch.no_grad():
            eval_loss = sum(((model(x) - y) ** 2).mean().item() for x, y in (batch(held) for _ in range(20))) / 20
        numel = sum(p.numel() for p in model.parameters())
        fp32 = fp32_allreduce_bytes(numel, world) * args.steps
        if hooked:
            sent, collectives = opt.comm_stats.bytes_sent, opt.comm_stats.collectives
        else:  # plain DDP: one fp32 ring allreduce of every gradient per step
            sent, collectives = fp32, None
        rows.append((name, eval_loss, sent, fp32, collectives, elapsed))
    if rank == 0:
        numel = sum(p.numel() for p in make_model(args.hidden).parameters())
        print(f"\n{world} ranks, {numel:,} parameters, {args.steps} steps, batch 64 per rank\n")
        print("| method | held-out loss | MB sent per rank | vs fp32 allreduce | collectives | wall s |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, loss, sent, fp32, coll, secs in rows:
            coll_s = "n/a (DDP)" if coll is None else str(coll)
            print(f"| {name} | {loss:.4f} | {sent / 1e6:.3f} | 1/{fp32 / sent:.1f} | {coll_s} | {secs:.1f} |")
        print(
            "\nBytes are the package's own count of what this rank sent; the AdamW row is the fp32 "
            "ring-allreduce volume DDP sends for the same gradients."
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
