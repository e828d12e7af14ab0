"""End-to-end check of the NCCL path: run it under torchrun on GPUs, then on CPU ranks, and compare.

    torchrun --standalone --nproc_per_node 2 tests/scripts/gpu_smoke.py --device cuda --out smoke_cuda.json
    torchrun --standalone --nproc_per_node 2 tests/scripts/gpu_smoke.py --device cpu --out smoke_cpu.json
    python tests/scripts/gpu_smoke.py --compare smoke_cuda.json smoke_cpu.json

(``tests/scripts/gpu_smoke.sh`` runs all three.) Each run trains a small BERT (random weights, synthetic
tokens, no dropout, no download) with DDP and the hf_zeroone hook, once with 1-bit Adam and once
with 0/1 Adam, through every phase of their schedules (0/1 Adam on a side CUDA stream), with
``check_replicas_every=1``. It checks, and writes to ``--out``:

* replicas bit-identical: the package's checksum at every backward pass (the hook's check, on
  NCCL gathered on the GPU), and the full parameters of every rank compared at the end;
* bytes as accounted: the bytes ``CommStats`` counted equal the bytes of the tensors actually
  handed to the backend's collectives (counted by a wrapper around them);
* with 4+ ranks, data-parallel sub-groups (2 x P/2): each group keeps its replicas identical.

``--compare`` then checks the losses of the GPU run against the CPU run (the first exact steps,
whose gradients travel as float8 messages by default, to a relative 1e-4; the rest on average) and the
bytes per step (equal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

from hf_zeroone import OneBitAdam, ZeroOneAdam
from hf_zeroone.comm import fp32_allreduce_bytes
from hf_zeroone.ddp_hook import register_zeroone_hook


class CountingCollectives:
    """Wraps a communicator's collectives and counts the bytes of the tensors handed to the backend."""

    def __init__(self, inner, world: int) -> None:
        self.inner, self.world, self.sent = inner, world, 0
        self.backend = inner.backend

    def all_reduce_sum(self, t):
        self.sent += fp32_allreduce_bytes(t.numel(), self.world, t.element_size())
        self.inner.all_reduce_sum(t)

    def all_to_all(self, out, inp):
        self.sent += inp.numel() * inp.element_size() * (self.world - 1) // self.world  # all rows but mine
        self.inner.all_to_all(out, inp)

    def all_gather(self, outs, inp):
        self.sent += inp.numel() * inp.element_size() * (self.world - 1)
        self.inner.all_gather(outs, inp)

    def close(self):
        self.inner.close()


def tiny_bert(device: torch.device):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForMaskedLM(config).to(device)


def batches(rank: int, steps: int, batch: int = 8, seq: int = 32) -> list[torch.Tensor]:
    """Synthetic token sequences with structure (a token predicts the next), different on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        start = torch.randint(0, 512, (batch, 1), generator=g)
        step = torch.randint(1, 4, (batch, 1), generator=g)
        out.append((start + step * torch.arange(seq)) % 512)
    return out


def train(name: str, device: torch.device, steps: int, group=None, side_stream: bool = False) -> dict:
    world = dist.get_world_size(group)
    model = tiny_bert(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25, process_group=group)
    if name == "onebit":
        opt = OneBitAdam(ddp.parameters(), lr=2e-3, freeze_step=steps // 4, check_replicas_every=1, process_group=group)
    else:
        opt = ZeroOneAdam(
            ddp.parameters(), lr=2e-3, var_freeze_step=steps // 3, var_update_scaler=2, local_step_scaler=4,
            local_step_clipper=4, check_replicas_every=1, process_group=group,
            exact_warmup_steps=2,  # then the paper's 1-bit gradient steps, so that every step kind runs
        )  # fmt: skip
    counter = CountingCollectives(opt.comm._coll, world)
    opt.comm._coll = counter
    register_zeroone_hook(ddp, opt)
    stream = torch.cuda.Stream(device) if side_stream and device.type == "cuda" else None
    losses, kinds, step_bytes = [], [], []
    rank = dist.get_rank()
    for ids in batches(rank, steps):
        ids = ids.to(device)
        if stream is not None:  # the whole step on a side stream: the hook's producer is that stream
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            opt.zero_grad()
            loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
        losses.append(loss.item())
        kinds.append(opt.last_step_kind.value)
        step_bytes.append(opt.last_step_stats.bytes_sent)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat, group=group)
    identical = all(torch.equal(everyone[0], other) for other in everyone[1:])
    # the replica checks' 24-byte gathers included, on both sides, and the first step's settings check
    accounted = opt.comm_stats.bytes_sent + opt.comm_stats.setup_bytes + opt.comm_stats.check_bytes
    result = {
        "losses": losses, "kinds": kinds, "step_bytes": step_bytes, "replicas_identical": identical,
        "accounted_bytes": accounted, "handed_bytes": counter.sent, "world": world,
    }  # fmt: skip
    opt.comm.close()
    return result


def run(args) -> int:
    device_type = args.device
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"device": str(device), "backend": backend, "world": world, "runs": {}}
    report["runs"]["onebit"] = train("onebit", device, args.steps)
    report["runs"]["zeroone"] = train("zeroone", device, args.steps, side_stream=True)
    if world >= 4 and world % 2 == 0:
        halves = [dist.new_group(list(range(k, k + world // 2))) for k in (0, world // 2)]
        mine = halves[rank // (world // 2)]
        report["runs"]["zeroone_subgroup"] = train("zeroone", device, max(8, args.steps // 2), mine)
    problems = []
    for name, r in report["runs"].items():
        if not r["replicas_identical"]:
            problems.append(f"{name}: replicas differ")
        if r["accounted_bytes"] != r["handed_bytes"]:
            counted, handed = r["accounted_bytes"], r["handed_bytes"]
            problems.append(f"{name}: CommStats counted {counted} bytes, the collectives got {handed}")
    report["problems"] = problems
    if rank == 0:
        for name, r in report["runs"].items():
            print(
                f"{name} ({backend}, {r['world']} ranks): final loss {r['losses'][-1]:.4f}, "
                f"replicas identical: {r['replicas_identical']}, bytes counted {r['accounted_bytes']} "
                f"= handed to the collectives {r['handed_bytes']}: {r['accounted_bytes'] == r['handed_bytes']}"
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()
    print(f"rank {rank}: {'OK' if not problems else 'FAILED: ' + '; '.join(problems)}")
    return 1 if problems else 0


def compare(path_a: str, path_b: str, tolerance: float) -> int:
    """Losses and bytes of two runs (GPU vs CPU): exact warm-up steps close, the rest close on average."""
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    problems = list(a.get("problems", [])) + list(b.get("problems", []))
    print(f"| run | {a['device']} final loss | {b['device']} final loss | mean abs diff | bytes equal |")
    print("|---|---:|---:|---:|---|")
    for name in sorted(set(a["runs"]) & set(b["runs"])):
        ra, rb = a["runs"][name], b["runs"][name]
        la, lb = torch.tensor(ra["losses"]), torch.tensor(rb["losses"])
        exact = [i for i, k in enumerate(ra["kinds"]) if k == "exact"][:3]
        diff = (la - lb).abs().mean().item()
        same_bytes = ra["step_bytes"] == rb["step_bytes"]
        print(f"| {name} | {la[-1]:.4f} | {lb[-1]:.4f} | {diff:.2e} | {same_bytes} |")
        if ra["kinds"] != rb["kinds"]:
            problems.append(f"{name}: step kinds differ")
        if not same_bytes:
            problems.append(f"{name}: bytes per step differ")
        if exact and not torch.allclose(la[exact], lb[exact], rtol=1e-4):
            problems.append(f"{name}: exact-phase losses differ: {la[exact].tolist()} vs {lb[exact].tolist()}")
        tail = slice(-max(1, len(la) // 4), None)
        if abs(la[tail].mean() / lb[tail].mean() - 1) > tolerance:
            problems.append(f"{name}: final losses differ by more than {tolerance:.0%}")
    print("OK" if not problems else "FAILED:\n" + "\n".join(problems))
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None, help="write the report (JSON) here")
    parser.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"), help="compare two reports and exit")
    parser.add_argument("--tolerance", type=float, default=0.03, help="relative loss gap allowed after warm-up")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare, args.tolerance)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
