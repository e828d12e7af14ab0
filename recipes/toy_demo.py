"""Two-process CPU demo: AdamW vs 1-bit Adam vs 0/1 Adam on a small regression model, over several seeds.

    torchrun --standalone --nproc_per_node 2 recipes/toy_demo.py   # offline, CPU, about a minute

Each rank trains the same MLP on its own data stream with plain DDP (AdamW) and with the hf_zeroone DDP hook
(OneBitAdam, ZeroOneAdam: default settings, the run length given by ``set_run_length``), once per seed. Rank 0
prints the held-out loss (mean over the seeds, and its standard deviation), the bytes this rank sent against an fp32
allreduce of the same gradients, and the collectives. Bytes and collectives are the same for every seed and machine;
a loss is one trajectory's end, so only the mean over seeds, with its spread, is a figure to quote.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_zeroone import OneBitAdam, ZeroOneAdam
from hf_zeroone.comm import fp32_allreduce_bytes
from hf_zeroone.ddp_hook import register_zeroone_hook


def make_model(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
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


#: each optimizer as a user first builds it: lr and weight decay, then (ours) the run length, no LR warm-up here
METHODS = {
    "AdamW (DDP, fp32 allreduce)": torch.optim.AdamW,
    "1-bit Adam + hook": OneBitAdam,
    "0/1 Adam + hook": ZeroOneAdam,
}


def train(cls: type, args: argparse.Namespace, seed: int, rank: int, world: int, bar) -> dict:  # noqa: ANN001
    model = make_model(args.hidden, seed)
    ddp = DDP(model)
    opt = cls(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    hooked = cls is not torch.optim.AdamW
    if hooked:
        opt.set_run_length(args.steps, 0)  # every schedule setting derived from the run length
        register_zeroone_hook(ddp, opt)
    gen = torch.Generator().manual_seed(1000 * (seed + 1) + rank)
    start = time.perf_counter()
    for _ in range(args.steps):
        x, y = batch(gen)
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        if bar is not None:
            bar.update(1)
    elapsed = time.perf_counter() - start
    if hooked:
        opt.synchronize()  # 0/1 Adam may end between two syncs: one model to evaluate
    held = torch.Generator().manual_seed(424242)
    with torch.no_grad():
        eval_loss = sum(((model(x) - y) ** 2).mean().item() for x, y in (batch(held) for _ in range(20))) / 20
    fp32 = fp32_allreduce_bytes(sum(p.numel() for p in model.parameters()), world) * args.steps
    if hooked:
        sent, collectives = opt.comm_stats.bytes_sent, opt.comm_stats.collectives
    else:  # plain DDP: one fp32 ring allreduce of every gradient per step
        sent, collectives = fp32, None
    return {"loss": eval_loss, "sent": sent, "fp32": fp32, "collectives": collectives, "wall": elapsed}


def table(rows: dict[str, list[dict]], seeds: list[int]) -> str:
    lines = [
        f"| method | held-out loss, mean of {len(seeds)} seeds | std over seeds | MB sent per rank | vs fp32 allreduce "
        "| collectives | wall s per run |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in rows.items():
        losses = [r["loss"] for r in runs]
        spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
        first = runs[0]
        coll = "n/a (DDP)" if first["collectives"] is None else str(first["collectives"])
        wall = statistics.mean(r["wall"] for r in runs)
        lines.append(
            f"| {name} | {statistics.mean(losses):.3f} | {spread:.3f} | {first['sent'] / 1e6:.3f} "
            f"| 1/{first['fp32'] / first['sent']:.1f} | {coll} | {wall:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated: one run of each method per seed")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if "RANK" not in os.environ:
        raise SystemExit(
            "toy_demo.py needs several processes: run it with\n"
            "    torchrun --standalone --nproc_per_node 2 recipes/toy_demo.py"
        )
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    bar = None
    if rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(seeds) * 3 * args.steps, desc="toy demo", unit="step", leave=False)
    rows: dict[str, list[dict]] = {}
    for seed in seeds:
        for name, cls in METHODS.items():
            rows.setdefault(name, []).append(train(cls, args, seed, rank, world, bar))
    if rank == 0:
        bar.close()
        numel = sum(p.numel() for p in make_model(args.hidden, 0).parameters())
        print(f"\n{world} ranks, {numel:,} parameters, {args.steps} steps, batch 64 per rank, seeds {args.seeds}\n")
        print(table(rows, seeds))
        print(
            "\nBytes are the package's own count of what this rank sent; the AdamW row is the fp32 "
            "ring-allreduce volume DDP sends for the same gradients."
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
