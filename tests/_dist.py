"""Run a function on N gloo ranks in fresh processes, with a timeout and every rank's stderr.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo process
group in each (short collective timeout; ``backend="nccl"`` puts rank ``r`` on GPU ``r``), calls
``fn(rank, world_size, *args)`` and returns the list of per-rank return values (which must be
picklable). Any exception, crash or timeout raises ``AssertionError`` with the traceback and the
stderr of every rank.
"""

from __future__ import annotations

import io
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, results, stderr_path, collective_timeout, backend):
    # Send this rank's stderr (and the C++ side's) to a file the parent can show.
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # The variables torchrun sets, so Trainer / Accelerate see the same distributed setup.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        out = fn(rank, world_size, *args)
        blob = io.BytesIO()
        torch.save(out, blob)  # plain bytes: tensors must outlive this process
        results.put((rank, "ok", blob.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    collective_timeout: float = 60.0,
    backend: str = "gloo",
) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.stderr") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, port, args, results, paths[r], collective_timeout, backend),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outcome: dict[int, tuple[str, Any]] = {}
        import queue as _queue
        import time

        deadline = time.monotonic() + timeout
        while len(outcome) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.5)
                outcome[rank] = (status, payload)
            except _queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and len(outcome) < world_size:
                    # A rank died without reporting; give the others a moment, then stop.
                    time.sleep(1.0)
                    while not results.empty():
                        rank, status, payload = results.get()
                        outcome[rank] = (status, payload)
                    break
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        problems = []
        for r in range(world_size):
            status, payload = outcome.get(r, ("missing", None))
            if status != "ok":
                try:
                    with open(paths[r], errors="replace") as f:
                        err = f.read()[-4000:]
                except OSError:
                    err = "(the rank never started)"
                problems.append(
                    f"--- rank {r}: {status} (exit code {procs[r].exitcode})\n"
                    f"{payload or ''}\n--- rank {r} stderr:\n{err}"
                )
        if problems:
            raise AssertionError(
                f"distributed run of {fn.__name__} on {world_size} ranks failed "
                f"(timeout {timeout}s):\n" + "\n".join(problems)
            )
        import torch

        return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]
