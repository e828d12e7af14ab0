#!/usr/bin/env python
"""Time a compression-phase training step three ways: DDP hook, communication after backward, none.

Same BERT-style model (default: 4 layers, hidden 256, seq 128, batch 8, about 5M parameters),
same data, 1-bit Adam in its compression phase, on P ranks (gloo on CPU):

* ``hook``: DDP + the hf_zeroone hook; 1-bit allreduce per bucket during backward;
* ``after_backward``: no DDP, the optimizer communicates in ``step()`` after backward (what
  DeepSpeed does);
* ``no_comm``: the same optimizer maths with a single-process communicator (nothing sent).

    torchrun --standalone --nproc_per_node 2 recipes/bench_overlap.py --steps 20

Rank 0 prints a markdown table of median step times and their ratios to ``no_comm``. Numbers
from one run are comparable with each other (same machine, same moment); machines here are
shared and noisy, so repeat a run before drawing conclusions.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def build(args):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden, max_position_embeddings=512,
    )  # fmt: skip
    return BertForMaskedLM(config)


def time_mode(mode: str, args, batches) -> list[float]:
    from hf_zeroone import OneBitAdam
    from hf_zeroone.comm import Communicator
    from hf_zeroone.ddp_hook import register_zeroone_hook

    model = build(args)
    if mode == "hook":
        net = DDP(model, forward_sync_buffers=False)
        opt = OneBitAdam(net.parameters(), lr=1e-4, freeze_step=2)
        register_zeroone_hook(net, opt)
    elif mode == "after_backward":
        # communicating in step() is the point of this mode: silence the warning meant for DDP users
        warnings.filterwarnings("ignore", message="OneBitAdam communicates in step")
        net = model
        opt = OneBitAdam(net.parameters(), lr=1e-4, freeze_step=2)
    else:
        net = model
        opt = OneBitAdam(net.parameters(), lr=1e-4, freeze_step=2, communicator=Communicator.local())
    times = []
    for i, (ids, labels) in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        loss = net(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if i >= 4:  # skip warm-up and the first compressed steps (bucket rebuild)
            times.append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(args.steps + 4):
        ids = torch.randint(5, args.vocab, (args.batch, args.seq), generator=g)
        labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        batches.append((ids, labels))
    medians = {}
    for mode in ("no_comm", "hook", "after_backward", "no_comm"):  # no_comm twice: drift check
        t = time_mode(mode, args, batches)
        medians.setdefault(mode, []).append(statistics.median(t))
    if rank == 0:
        numel = sum(p.numel() for p in build(args).parameters())
        base = min(medians["no_comm"])
        print(f"\n{world} ranks, {numel / 1e6:.1f}M parameters, batch {args.batch} x {args.seq}, {args.steps} steps")
        print("| mode | median step s | vs no_comm |\n|---|---:|---:|")
        for mode in ("no_comm", "hook", "after_backward"):
            m = min(medians[mode])
            print(f"| {mode} | {m:.3f} | {m / base:.2f} |")
        spread = max(medians["no_comm"]) / min(medians["no_comm"])
        print(f"\nno_comm measured twice (first and last): spread {spread:.2f}x, a measure of the machine's noise")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
