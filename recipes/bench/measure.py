"""One benchmark rank: every method on every link rate, each step timed and its bytes counted.

Run by ``torchrun`` (inside the network namespace when there is one), one process per rank::

    torchrun --standalone --nproc_per_node 2 -m bench.measure CONFIG.json

``CONFIG.json`` is written by :mod:`bench.cli`. Rank 0 sets each link rate itself (it runs inside the
namespace, as root), reads the loopback counters around every phase of every method after a barrier, prints
progress lines (``@@`` lines are for the parent's progress bar) and writes the raw records of all ranks.

No ``from __future__ import annotations`` here: DDP checks the hooks' ``GradBucket`` annotation at run time.
"""

import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.netns import qdisc_stats_here, read_wire_counters, set_rate_here
from bench.workload import build_model, make_batches

METHODS: dict[str, str] = {
    "ddp_fp32": "DDP fp32 AdamW",
    "fp16": "DDP fp16_compress_hook + AdamW",
    "powersgd": "DDP PowerSGD hook + AdamW",
    "onebit": "1-bit Adam + hf_zeroone hook",
    "zeroone": "0/1 Adam + hf_zeroone hook",
    "nocomm": "no-communication step (reference)",
}
DEFAULT_METHODS = "ddp_fp32,fp16,powersgd,onebit,zeroone,nocomm"


def phase_ranges(method: str, cfg: dict[str, Any], n_steps: int) -> list[tuple[str, int, int]]:
    """``(name, first step, end step)`` of each phase of ``method`` (bytes are measured per phase)."""
    w, v = cfg["warmup_steps"], cfg["var_freeze_step"]
    if method == "powersgd":
        cuts = [("warm-up", 0, max(2, w)), ("compression", max(2, w), n_steps)]
    elif method == "onebit":
        cuts = [("warm-up", 0, w), ("compression", w, n_steps)]
    elif method == "zeroone":
        given = cfg["zeroone_exact_warmup_steps"]  # None: the optimizer's default, all of phase 1
        e = v if given is None else min(given, v)
        cuts = [("warm-up", 0, e), ("compression", e, v), ("local", v, n_steps)]
    else:
        cuts = [("all", 0, n_steps)]
    out = []
    for name, a, b in cuts:
        a, b = min(a, n_steps), min(b, n_steps)
        if b > a:
            out.append((name, a, b))
    return out


@dataclass
class HookCounter:
    """State of :func:`counting_hook`: wraps a torch hook and counts what it sends (expected ring bytes)."""

    inner: Callable[[Any, dist.GradBucket], torch.futures.Future]
    inner_state: Any
    kind: str
    world_size: int
    bytes_this_step: int = 0
    collectives_this_step: int = 0

    def account(self, bucket: dist.GradBucket) -> None:
        from hf_zeroone.comm import fp32_allreduce_bytes

        p, numel = self.world_size, bucket.buffer().numel()
        if self.kind == "fp16":
            self.bytes_this_step += fp32_allreduce_bytes(numel, p, element_size=2)
            self.collectives_this_step += 1
        elif self.kind == "powersgd":
            st = self.inner_state
            if st.iter < st.start_powerSGD_iter:
                self.bytes_this_step += fp32_allreduce_bytes(numel, p)
                self.collectives_this_step += 1
                return
            plain = ps = qs = 0  # the hook's rule: vectors and matrices not worth it go uncompressed
            for g in bucket.gradients():
                if g.dim() <= 1:
                    plain += g.numel()
                    continue
                n = g.shape[0]
                m = g.numel() // n
                r = min(n, m, st.matrix_approximation_rank)
                if (n + m) * r * st.min_compression_rate < n * m:
                    ps, qs = ps + n * r, qs + m * r
                else:
                    plain += g.numel()
            self.bytes_this_step += sum(fp32_allreduce_bytes(x, p) for x in (plain, ps, qs))
            self.collectives_this_step += 3


def counting_hook(state: HookCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that counts a bucket, then runs the wrapped hook.

    torch's PowerSGD hook issues its P and Q allreduces from future callbacks. With gloo and more than one
    bucket, the ranks can then issue collectives in different orders (gloo aborted with "Received data size
    doesn't match expected size" in a run of this benchmark), so for PowerSGD we wait for each bucket before
    backward goes on: correct, but PowerSGD loses its overlap with backward here.
    """
    state.account(bucket)
    fut = state.inner(state.inner_state, bucket)
    if state.kind == "powersgd":
        fut.wait()
    return fut


def local_only_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that sends nothing: the local gradient comes back at once."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _count_ddp_buckets(ddp: torch.nn.Module) -> int:
    """Number of gradient buckets DDP reduces (``-1`` if torch's private API does not tell)."""
    try:
        return len(ddp.reducer._get_zeros_like_grad_buckets())
    except Exception:  # noqa: BLE001 - private API, best effort
        return -1


def _ddp_kwargs() -> dict[str, Any]:
    """Keep DDP from broadcasting buffers every forward (torch >= 2.13 renamed the option)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def run_method(
    method: str,
    cfg: dict[str, Any],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Train a fresh model with ``method`` for the configured steps on this rank; rank 0 returns the record."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.comm import fp32_allreduce_bytes
    from hf_zeroone.ddp_hook import register_zeroone_hook

    rank, world = dist.get_rank(), dist.get_world_size()
    n_steps = cfg["nocomm_steps"] if method == "nocomm" else cfg["steps"]
    model = build_model(cfg)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ddp = DistributedDataParallel(model, **_ddp_kwargs())
    adam = {"lr": cfg["lr"], "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": cfg["weight_decay"]}
    exact = {"exact_step_dtype": cfg["exact_step_dtype"]} if cfg.get("exact_step_dtype") else {}  # else theirs
    counter: HookCounter | None = None
    if method == "onebit":
        opt: torch.optim.Optimizer = OneBitAdam(ddp.parameters(), **adam, **exact, freeze_step=cfg["warmup_steps"])
        register_zeroone_hook(ddp, opt)
    elif method == "zeroone":
        opt = ZeroOneAdam(
            ddp.parameters(),
            **adam,
            **exact,
            var_freeze_step=cfg["var_freeze_step"],
            var_update_scaler=cfg["var_update_scaler"],
            local_step_scaler=cfg["local_step_scaler"],
            local_step_clipper=cfg["local_step_clipper"],
            exact_warmup_steps=cfg["zeroone_exact_warmup_steps"],
        )
        register_zeroone_hook(ddp, opt)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), **adam)
        if method == "fp16":
            counter = HookCounter(default_hooks.fp16_compress_hook, None, "fp16", world)
        elif method == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=cfg["powersgd_rank"],
                start_powerSGD_iter=max(2, cfg["warmup_steps"]),
            )
            counter = HookCounter(powerSGD_hook.powerSGD_hook, state, "powersgd", world)
        if counter is not None:
            ddp.register_comm_hook(counter, counting_hook)
        elif method == "nocomm":
            ddp.register_comm_hook(None, local_only_hook)
    warmup = max(1, cfg["warmup_steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))

    phases = phase_ranges(method, cfg, n_steps)
    starts = {a for _, a, _ in phases}
    in_netns = cfg["in_netns"]
    marks: dict[int, dict[str, int]] = {}
    wire_after: list[int] = []
    times, losses, kinds, acc_bytes, acc_coll = [], [], [], [], []
    buckets = -1
    torch.manual_seed(cfg["seed"] + 1 + rank)  # same dropout masks for every method
    ddp.train()
    for step in range(n_steps):
        if step in starts:
            dist.barrier()  # everything sent before this point has arrived: the window is exact
            if rank == 0 and in_netns:
                marks[step] = read_wire_counters()
        inputs, labels = batches[step]
        t0 = time.perf_counter()
        loss = ddp(input_ids=inputs, labels=labels).loss
        loss.backward()
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if method in ("onebit", "zeroone"):
            kinds.append(opt.last_step_kind.value)
            acc_bytes.append(int(opt.last_step_stats.bytes_sent))
            acc_coll.append(int(opt.last_step_stats.collectives))
        elif method == "ddp_fp32":
            kinds.append("fp32_allreduce")
            acc_bytes.append(fp32_allreduce_bytes(numel, world))
            if step <= 1:  # one allreduce per bucket; DDP rebuilds its buckets once, after the first step
                buckets = _count_ddp_buckets(ddp)
            acc_coll.append(buckets)
        elif method == "nocomm":
            kinds.append("none")
            acc_bytes.append(0)
            acc_coll.append(0)
        else:
            assert counter is not None
            if method == "fp16":
                kinds.append("fp16_allreduce")
            else:
                kinds.append("fp32_allreduce" if step < max(2, cfg["warmup_steps"]) else "powersgd")
            acc_bytes.append(counter.bytes_this_step)
            acc_coll.append(counter.collectives_this_step)
            counter.bytes_this_step = counter.collectives_this_step = 0
        if rank == 0 and in_netns:
            wire_after.append(read_wire_counters()["tx_bytes"])
        if rank == 0 and ((step + 1) % cfg["log_every"] == 0 or step + 1 == n_steps):
            log(
                f"{method:<9} step {step + 1:>3}/{n_steps} {kinds[-1]:<16} "
                f"loss {losses[-1]:.3f} {times[-1] * 1e3:6.0f} ms"
            )
    dist.barrier()
    if rank == 0 and in_netns:
        marks[n_steps] = read_wire_counters()
    if hasattr(opt, "comm"):
        opt.comm.close()
    per_rank = {"time_s": times, "loss": losses, "acc_bytes": acc_bytes, "acc_coll": acc_coll}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, per_rank)
    if rank != 0:
        return {}
    return {
        "method": method,
        "label": METHODS[method],
        "steps": n_steps,
        "numel": numel,
        "ddp_buckets": buckets if method == "ddp_fp32" and buckets >= 0 else None,
        "phases": [{"name": n, "start": a, "end": b} for n, a, b in phases],
        "kinds": kinds,
        "marks": {str(k): v for k, v in marks.items()},
        "wire_after_step": wire_after,
        "ranks": gathered,
    }


def _warm_up_process(cfg: dict[str, Any], batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One forward/backward on a throwaway model: the libraries' lazy initialisation stays out of the timings."""
    model = build_model(cfg)
    model(input_ids=batch[0], labels=batch[1]).loss.backward()


def bench_pack_unpack(numel: int, reps: int) -> dict[str, Any]:
    """GB/s of fp32 input through ``pack_signs`` + ``unpack_signs`` on one CPU thread."""
    from hf_zeroone.compression import pack_signs, unpack_signs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        numel -= numel % 8
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        packed = pack_signs(x)
        assert torch.equal(unpack_signs(packed) >= 0, x >= 0), "pack/unpack round trip lost signs"
        t_pack, t_unpack = [], []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            packed = pack_signs(x)
            t1 = time.perf_counter()
            unpack_signs(packed)
            t2 = time.perf_counter()
            t_pack.append(t1 - t0)
            t_unpack.append(t2 - t1)
        tp, tu = statistics.median(t_pack[2:]), statistics.median(t_unpack[2:])
        gb = numel * 4 / 1e9
        return {
            "numel": numel,
            "reps": reps,
            "pack_ms": tp * 1e3,
            "unpack_ms": tu * 1e3,
            "pack_gbps": gb / tp,
            "unpack_gbps": gb / tu,
            "pack_unpack_gbps": gb / (tp + tu),
        }
    finally:
        torch.set_num_threads(threads)


def worker_main(config_path: str) -> None:
    """One rank: for each link rate, every method in turn on the same data.

    Rank 0 sets each rate between barriers (every rank idle), reads the loopback counters and the tbf
    statistics when the rate is done, and writes the raw records of all ranks to ``result_path``.
    """
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["collective_timeout"]))
    rank = dist.get_rank()
    methods = [m for m in cfg["methods"].split(",") if m]
    batches = make_batches(cfg, rank, max(cfg["steps"], cfg["nocomm_steps"]))
    _warm_up_process(cfg, batches[0])
    results = []
    for rate in cfg["rates"]:
        dist.barrier()  # every rank idle: the link can change
        if rank == 0:
            if cfg["in_netns"]:
                set_rate_here(rate, cfg["tbf_burst"], cfg["tbf_latency"])
            before, t0 = read_wire_counters()["tx_bytes"], time.perf_counter()
            print(f"@@rate_start {rate}", flush=True)
        dist.barrier()
        records = []
        for method in methods:
            dist.barrier()
            t_method = time.perf_counter()
            rec = run_method(method, cfg, batches, lambda msg, rate=rate: print(f"[{rate}] {msg}", flush=True))
            if rank == 0:
                rec["wall_s"] = time.perf_counter() - t_method
                records.append(rec)
                print(f"@@done {method}", flush=True)
            gc.collect()
        dist.barrier()
        if rank == 0:
            entry: dict[str, Any] = {"rate": rate, "methods": records, "wall_s": time.perf_counter() - t0}
            entry["netns_tx_bytes"] = read_wire_counters()["tx_bytes"] - before if cfg["in_netns"] else None
            entry["qdisc"] = qdisc_stats_here() if cfg["in_netns"] else None
            results.append(entry)
    if rank == 0:
        Path(cfg["result_path"]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: torchrun --standalone --nproc_per_node P -m bench.measure CONFIG.json")
    worker_main(sys.argv[1])
