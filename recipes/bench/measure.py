"""One rank of the benchmark (``torchrun -m bench.measure CONFIG.json``): every method on every link rate.

No ``from __future__ import annotations``: DDP checks its hooks' annotations at run time."""

import contextlib
import gc
import inspect
import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from transformers import BertConfig, BertForMaskedLM

from bench.netns import read_wire_counters, set_rate_here
from hf_zeroone import OneBitAdam, ZeroOneAdam
from hf_zeroone.comm import fp32_allreduce_bytes
from hf_zeroone.ddp_hook import register_zeroone_hook

METHODS: dict[str, str] = {
    "ddp_fp32": "DDP fp32 AdamW", "fp16": "DDP fp16_compress_hook + AdamW", "powersgd": "DDP PowerSGD hook + AdamW",
    "onebit": "1-bit Adam + hf_zeroone hook", "zeroone": "0/1 Adam + hf_zeroone hook",
    "nocomm": "no-communication step (reference)",
}  # fmt: skip


def build_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """A seeded, randomly initialised ``BertForMaskedLM`` from a ``BertConfig``."""
    config = BertConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"], pad_token_id=0,
        num_attention_heads=cfg["heads"], intermediate_size=cfg["intermediate"],
        max_position_embeddings=max(cfg["seq_len"], 16),
    )  # fmt: skip
    torch.manual_seed(cfg["seed"])
    return BertForMaskedLM(config)


def prepare_text_blocks(cfg: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Tokenize the embedded corpus of ``recipes/pretrain.py`` into ``blocks.pt``; return what the ranks need."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pretrain

    texts = pretrain.embedded_corpus(cfg["corpus_chars"])
    tok_args = SimpleNamespace(tokenizer_name=None, vocab_size=cfg["vocab"])
    tokenizer = pretrain.build_tokenizer(tok_args, texts, out_dir / "tokenizer")
    blocks = pretrain.make_blocks(tokenizer, texts, cfg["seq_len"])
    torch.save(blocks, out_dir / "blocks.pt")
    return {"blocks_path": str(out_dir / "blocks.pt"), "vocab": len(tokenizer), "mask_id": tokenizer.mask_token_id,
            "text_sequences": int(blocks.shape[0]), "text_chars": sum(len(t) for t in texts)}  # fmt: skip


def make_batches(cfg: dict[str, Any], rank: int, n_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_steps`` masked-LM batches ``(input_ids, labels)`` for ``rank``, 15% of positions masked."""
    batch, gen = cfg["batch_size"], torch.Generator().manual_seed(cfg["seed"] * 1000 + 17 + rank)
    blocks = torch.load(cfg["blocks_path"], weights_only=True)
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(cfg["seed"]))
    mine = order[rank :: cfg["nproc"]]  # one shuffle for all ranks, then every P-th block, cycled
    tokens = blocks[mine[torch.arange(n_steps * batch) % len(mine)]]
    masked = torch.rand(tokens.shape, generator=gen) < 0.15
    masked[:, 0] |= ~masked.any(dim=1)  # at least one masked position per sequence
    labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
    inputs = torch.where(masked, torch.full_like(tokens, cfg["mask_id"]), tokens)
    return [(inputs[s * batch : (s + 1) * batch], labels[s * batch : (s + 1) * batch]) for s in range(n_steps)]


def phase_ranges(method: str, cfg: dict[str, Any], n_steps: int) -> list[tuple[str, int, int]]:
    """``(name, first step, end step)`` of each non-empty phase of ``method``."""
    w, v = cfg["warmup_steps"], cfg["var_freeze_step"]
    e = v if cfg["zeroone_exact_warmup_steps"] is None else min(cfg["zeroone_exact_warmup_steps"], v)
    cuts = {
        "powersgd": [("warm-up", 0, max(2, w)), ("compression", max(2, w), n_steps)],
        "onebit": [("warm-up", 0, w), ("compression", w, n_steps)],
        "zeroone": [("warm-up", 0, e), ("compression", e, v), ("local", v, n_steps)],
    }.get(method, [("all", 0, n_steps)])
    return [(name, min(a, n_steps), min(b, n_steps)) for name, a, b in cuts if min(b, n_steps) > min(a, n_steps)]


def counting_hook(state: dict[str, Any], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Add the ring-allreduce bytes and collectives of torch's fp16 or PowerSGD hook to ``state``, then run it."""
    ps, numel = state["powersgd"], bucket.buffer().numel()
    if ps is None or ps.iter < ps.start_powerSGD_iter:  # fp16, or PowerSGD's fp32 allreduce before it starts
        sizes, element_size = [numel], 2 if ps is None else 4
    else:
        sizes, element_size = [0, 0, 0], 4  # uncompressed, P, Q
        for g in bucket.gradients():  # the hook's rule: vectors and matrices not worth compressing go uncompressed
            n, m = (g.shape[0], g.numel() // g.shape[0]) if g.dim() > 1 else (0, 0)
            r = min(n, m, ps.matrix_approximation_rank)
            if g.dim() > 1 and (n + m) * r * ps.min_compression_rate < n * m:
                sizes[1], sizes[2] = sizes[1] + n * r, sizes[2] + m * r
            else:
                sizes[0] += g.numel()
    state["bytes"] += sum(fp32_allreduce_bytes(x, dist.get_world_size(), element_size) for x in sizes)
    state["collectives"] += len(sizes)
    if ps is None:
        return default_hooks.fp16_compress_hook(None, bucket)
    fut = powerSGD_hook.powerSGD_hook(ps, bucket)
    fut.wait()  # with gloo the ranks must issue every bucket's collectives in the same order
    return fut


def local_only_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook that sends nothing: the local gradient comes back at once."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def run_method(method: str, cfg: dict[str, Any], batches: list, log: Callable[[str], None]) -> dict[str, Any]:
    """Train a fresh model with ``method`` on this rank; rank 0 returns the raw record of all ranks."""
    rank, world, w = dist.get_rank(), dist.get_world_size(), cfg["warmup_steps"]
    n_steps = cfg["nocomm_steps"] if method == "nocomm" else cfg["steps"]
    model = build_model(cfg)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sync = "forward_sync_buffers"  # no buffer broadcast every forward (older torch: broadcast_buffers)
    sync = sync if sync in inspect.signature(DistributedDataParallel).parameters else "broadcast_buffers"
    ddp = DistributedDataParallel(model, **{sync: False})
    params, counter = list(ddp.parameters()), {"bytes": 0, "collectives": 0, "powersgd": None}
    adam = {"lr": cfg["lr"], "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": cfg["weight_decay"]}
    ours = dict(adam, exact_step_dtype=cfg["exact_step_dtype"])
    if method == "onebit":
        opt = OneBitAdam(params, **ours, freeze_step=w)
    elif method == "zeroone":
        kw = {k: cfg[k] for k in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")}
        opt = ZeroOneAdam(params, **ours, **kw, exact_warmup_steps=cfg["zeroone_exact_warmup_steps"])
    else:
        opt = torch.optim.AdamW(params, **adam)
    if method in ("onebit", "zeroone"):
        register_zeroone_hook(ddp, opt)
    elif method == "nocomm":
        ddp.register_comm_hook(None, local_only_hook)
    elif method == "powersgd":
        counter["powersgd"] = powerSGD_hook.PowerSGDState(None, cfg["powersgd_rank"], start_powerSGD_iter=max(2, w))
    if method in ("fp16", "powersgd"):
        ddp.register_comm_hook(counter, counting_hook)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, w)))
    phases = phase_ranges(method, cfg, n_steps)
    starts, wire = {a for _, a, _ in phases}, rank == 0 and cfg["in_netns"]
    marks: dict[int, dict[str, int]] = {}
    wire_after, times, losses, kinds, acc_bytes, acc_coll = [], [], [], [], [], []
    buckets = -1
    torch.manual_seed(cfg["seed"] + 1 + rank)  # same dropout masks for every method
    ddp.train()
    for step in range(n_steps):
        if step in starts:
            dist.barrier()  # everything sent before this point has arrived: the window is exact
            if wire:
                marks[step] = read_wire_counters()
        t0 = time.perf_counter()
        loss = ddp(input_ids=batches[step][0], labels=batches[step][1]).loss
        loss.backward()
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if method in ("onebit", "zeroone"):
            kind, sent, coll = opt.last_step_kind.value, opt.last_step_stats.bytes_sent, opt.last_step_stats.collectives
        elif method == "ddp_fp32":
            if step <= 1:  # one allreduce per bucket; DDP rebuilds its buckets once, after the first step
                with contextlib.suppress(Exception):  # private API: the collectives stay unknown (-1)
                    buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
            kind, sent, coll = "fp32_allreduce", fp32_allreduce_bytes(numel, world), buckets
        elif method == "nocomm":
            kind, sent, coll = "none", 0, 0
        else:
            kind = "fp16_allreduce" if method == "fp16" else "fp32_allreduce"
            kind = "powersgd" if method == "powersgd" and step >= max(2, w) else kind
            sent, coll = counter["bytes"], counter["collectives"]
            counter["bytes"] = counter["collectives"] = 0
        kinds.append(kind)
        acc_bytes.append(int(sent))
        acc_coll.append(int(coll))
        if wire:
            wire_after.append(read_wire_counters()["tx_bytes"])
        if rank == 0 and ((step + 1) % cfg["log_every"] == 0 or step + 1 == n_steps):
            log(f"{method:<9} step {step + 1:>3}/{n_steps} {kind:<16} loss {losses[-1]:.3f} {times[-1] * 1e3:6.0f} ms")
    dist.barrier()
    if wire:
        marks[n_steps] = read_wire_counters()
    if hasattr(opt, "comm"):
        opt.comm.close()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"time_s": times, "loss": losses, "acc_bytes": acc_bytes, "acc_coll": acc_coll})
    if rank != 0:
        return {}
    phase_list = [{"name": n, "start": a, "end": b} for n, a, b in phases]
    return {"method": method, "label": METHODS[method], "steps": n_steps, "numel": numel, "phases": phase_list,
            "ddp_buckets": buckets if method == "ddp_fp32" and buckets >= 0 else None, "kinds": kinds,
            "marks": {str(k): v for k, v in marks.items()}, "wire_after_step": wire_after,
            "ranks": gathered}  # fmt: skip


def worker_main(config_path: str) -> None:
    """One rank: for each link rate (set by rank 0 between barriers), every method on the same batches."""
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["collective_timeout"]))
    rank, results = dist.get_rank(), []
    batches = make_batches(cfg, rank, max(cfg["steps"], cfg["nocomm_steps"]))
    build_model(cfg)(input_ids=batches[0][0], labels=batches[0][1]).loss.backward()  # lazy init out of timings
    for rate in cfg["rates"]:
        dist.barrier()  # every rank idle: the link can change
        if rank == 0:
            if cfg["in_netns"]:
                set_rate_here(rate, cfg["tbf_burst"], cfg["tbf_latency"])
            before, t0, records = read_wire_counters()["tx_bytes"], time.perf_counter(), []
            print(f"== link {rate}", flush=True)
        dist.barrier()
        for method in cfg["methods"]:
            dist.barrier()
            t_method = time.perf_counter()
            rec = run_method(method, cfg, batches, lambda msg, rate=rate: print(f"[{rate}] {msg}", flush=True))
            if rank == 0:
                records.append(dict(rec, wall_s=time.perf_counter() - t_method))
                done = len(results) * len(cfg["methods"]) + len(records)
                print(f"progress: {done}/{len(cfg['rates']) * len(cfg['methods'])} method runs done", flush=True)
            gc.collect()
        dist.barrier()
        if rank == 0:
            tx = read_wire_counters()["tx_bytes"] - before if cfg["in_netns"] else None
            results.append({"rate": rate, "methods": records, "wall_s": time.perf_counter() - t0, "netns_tx_bytes": tx})
    if rank == 0:
        Path(cfg["result_path"]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(sys.argv[1])
