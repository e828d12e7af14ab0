"""What runs a :class:`~hf_zeroone.comm.Communicator`'s jobs: one worker thread, CUDA streams, a process group.

**One worker thread per communicator, on every backend.** Jobs (the maths of a compressed
allreduce and its collectives) run one at a time, in submission order, on a daemon thread, and
their results come back as ``torch.futures.Future`` objects. With gloo the thread is what lets
backward go on while a bucket is communicated (gloo collectives block the calling thread), and
no collective is ever issued from inside a future callback (a blocking gloo collective there
deadlocks once there are two buckets). With NCCL the same thread is kept, so that issue order,
failure handling and the maths are the same code for both backends: an NCCL ``Work.wait()``
only makes the current CUDA stream wait, so the thread enqueues kernels and collectives and
never waits for the GPU.

**CUDA ordering, by construction.** For a job whose tensors live on a CUDA device:

1. :meth:`_SerialExecutor.submit` (the caller's thread, e.g. DDP's hook during backward) records
   an event on the caller's *current* stream of that device: everything the caller enqueued
   before, the message it wrote included, comes before the event.
2. The worker sets its current device once per device, and owns one stream per device. That
   stream waits for the event, the job runs with it current (compression kernels, and the
   collectives, which order themselves after the current stream), and every input tensor is
   marked as used on it (``Tensor.record_stream``), so the caching allocator does not hand an
   input's memory to its producer's stream while the job may still read it.
3. The result future is CUDA-aware (``Future(devices=[device])``) and is completed while the
   worker's stream is current, so it records an event there. ``wait()`` on it, and every
   ``then`` callback (which torch runs on a stream from its pool), make their stream wait for
   that event and mark the result as used there: a consumer on any stream reads the result
   only after the kernels that wrote it, and backward's stream never waits for communication.

No step reads a device value on the host, so nothing here drains the GPU queue.

**The process group.** :func:`_dedicated_collectives` builds a group with the ranks of the
data-parallel group that only this package uses, directly on the default store under a prefix
unique to the launch attempt (torchelastic run id and restart count), the communicator and its
ranks. Only the ranks of that group take part, so it works for data-parallel sub-groups (each
DP group of a TP x DP layout builds its own, no world-wide call), and a restarted rank never
reads a dead peer's keys (``dist.new_group`` would reuse them after a ``torchrun --max-restarts``
restart). gloo and NCCL get a backend object of their own on that store; other backends fall
back to ``dist.new_group(..., use_local_synchronization=True)``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_Job = tuple[Callable[[], Any], torch.futures.Future, "torch.device | None", Any, tuple[Tensor, ...]]

#: every executor whose worker thread may still run (its thread keeps it alive until it ends)
_RUNNING_EXECUTORS: weakref.WeakSet[_SerialExecutor] = weakref.WeakSet()


def stop_all_workers(timeout: float) -> None:
    """Stop every worker thread and wait up to ``timeout`` seconds for each (called at interpreter exit).

    A worker of a communicator that was already garbage-collected is still running (idle) and may
    drop the last reference to a process group; a gloo group destroyed on a daemon thread while
    the interpreter finalises aborts the process ("terminate called without an active exception").
    Joining every worker before finalisation leaves no Python code running on those threads.
    """
    for executor in list(_RUNNING_EXECUTORS):
        if executor._thread.is_alive():  # a worker told to stop may not have finished its last job
            executor.shutdown(timeout=timeout)


def _cuda_device(tensors: Sequence[Tensor]) -> torch.device | None:
    """The device of the first CUDA tensor, or ``None`` (the job then needs no stream handling)."""
    return next((t.device for t in tensors if t.is_cuda), None)


class _SerialExecutor:
    """Runs submitted jobs one at a time, in order, on a daemon thread; results come as futures.

    See the module docstring for the CUDA stream and event protocol.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        #: the exception of the first job that failed; after it no job runs (see :meth:`refusal`)
        self.failure: BaseException | None = None
        #: the worker's own stream per CUDA device (created by the worker on first use)
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _RUNNING_EXECUTORS.add(self)

    def refusal(self) -> RuntimeError:
        """The error every job gets once a job has failed."""
        assert self.failure is not None
        err = RuntimeError(
            "hf_zeroone: this rank's communicator stopped after a communication job failed "
            f"({type(self.failure).__name__}: {self.failure}). Its collectives are now out of step with the "
            "other ranks (they end at their collective timeout), so it refuses all further work. Fix the cause "
            "and restart the job, e.g. from the last checkpoint."
        )
        err.__cause__ = self.failure
        return err

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self.streams.get(device)
        if stream is None:
            torch.cuda.set_device(device)  # the worker's current device: what device-less calls use
            stream = self.streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut, device, ready, tensors = item
            if self.failure is not None:
                # A failed job may have stopped between two collectives: running later jobs would
                # pair this rank's collectives with different ones on the other ranks.
                fut.set_exception(self.refusal())
                continue
            self._execute(job, fut, device, ready, tensors)
            # Not kept until the next job arrives: the finished job's inputs (a message) and result.
            item = job = fut = device = ready = tensors = None

    def _execute(
        self, job: Callable[[], Any], fut: torch.futures.Future, device: torch.device | None, ready: Any, tensors: Any
    ) -> None:
        stream = None
        try:
            if device is not None:
                stream = self._stream(device)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.failure = exc
            fut.set_exception(exc)
            return
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                if stream is not None:
                    stream.wait_event(ready)  # after everything the producer enqueued before submit
                    for t in tensors:
                        if t.is_cuda:
                            t.record_stream(stream)
                result = job()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                self.failure = exc
                fut.set_exception(exc)
                return
            # Completed with the worker's stream current: a CUDA-aware future records its event here.
            fut.set_result(result)

    def on_worker_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, job: Callable[[], Any], tensors: Sequence[Tensor] = ()) -> torch.futures.Future:
        """Queue ``job``; ``tensors`` are the inputs it reads or writes (they fix the device and streams)."""
        if self.failure is not None:
            raise self.refusal()
        device = _cuda_device(tensors)
        ready = None
        if device is None:
            fut: torch.futures.Future = torch.futures.Future()
        else:
            fut = torch.futures.Future(devices=[device])
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        self._jobs.put((job, fut, device, ready, tuple(tensors)))
        return fut

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop after the jobs already submitted; wait up to ``timeout`` seconds for the thread."""
        self._jobs.put(None)
        if timeout is not None and not self.on_worker_thread():
            self._thread.join(timeout)


class _Collectives:
    """The three collectives the package needs, on a registered process group or a backend object.

    ``raw``: ``group`` is a backend object (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) built by
    :func:`_dedicated_collectives`, called directly; otherwise a registered group for ``dist.*``.
    ``backend`` names the backend (``"gloo"``, ``"nccl"``, ...): it decides where a tensor made
    up by the package (a checksum) must live, see :func:`collective_device`.
    """

    def __init__(self, group: Any, raw: bool, backend: str) -> None:
        self.group, self.raw, self.backend = group, raw, backend

    def all_reduce_sum(self, t: Tensor) -> None:
        if self.raw:
            self.group.allreduce([t]).wait()
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def all_to_all(self, out: Tensor, inp: Tensor) -> None:
        if self.raw:
            self.group.alltoall_base(out, inp, [], [], dist.AllToAllOptions()).wait()
        else:
            dist.all_to_all_single(out, inp, group=self.group)

    def all_gather(self, outs: list[Tensor], inp: Tensor) -> None:
        if self.raw:
            self.group.allgather([outs], [inp]).wait()
        else:
            dist.all_gather(outs, inp, group=self.group)

    def close(self) -> None:
        """Release an NCCL backend object (best effort; gloo's are released by the garbage collector)."""
        shutdown = getattr(self.group, "shutdown", None) if self.raw and self.backend == "nccl" else None
        if shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()


class _LoopbackCollectives:
    """Collectives of one process standing in for ``world_size`` ranks that all hold the same input.

    Every "peer" sends what this process sends: a sum is ``world_size`` times the input (so a mean
    is the input), and rank ``rank`` receives its own send buffer's row ``rank`` from every peer.
    A gather cannot be right: each peer would send the result of its own share of the work, which
    this process never computes, so every slot gets this rank's. Compressed results are therefore
    not those of a real run. Used to run and time the whole arithmetic in one process
    (``recipes/bench_kernels.py``, ``recipes/bench_step.py --loopback``, the single-GPU tests).
    """

    backend = "loopback"

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce_sum(self, t: Tensor) -> None:
        t.mul_(self.world_size)

    def all_to_all(self, out: Tensor, inp: Tensor) -> None:
        out.copy_(inp[self.rank].expand_as(out))

    def all_gather(self, outs: list[Tensor], inp: Tensor) -> None:
        for o in outs:
            o.copy_(inp)

    def close(self) -> None:
        pass


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where a small tensor the package makes up (a checksum) must live for a collective on ``backend``.

    NCCL only takes CUDA tensors: the tensors' CUDA device, or the current CUDA device when the
    tensors are elsewhere. gloo and multi-device groups (``"cpu:gloo,cuda:nccl"``) take CPU
    tensors; other backends get the tensors' own device.
    """
    if backend == "nccl":
        if device.type == "cuda":
            return device
        return torch.device("cuda", torch.cuda.current_device())
    if backend in ("gloo", "mpi") or "cpu:" in backend:
        return torch.device("cpu")
    return device


def _group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout of ``group`` (default group if ``None``), or ``None`` if it cannot be read."""
    pg = group if group is not None else dist.group.WORLD
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return pg._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001 - private API, best effort
            continue
    return None


def _backend_object(backend: str, store: Any, rank: int, size: int, timeout: timedelta, name: str) -> Any:
    """A gloo or NCCL backend object of ``size`` ranks on ``store`` (as ``dist.new_group`` builds one)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    for attribute, value in (("group_name", name),):  # for NCCL's logs; absent from older releases
        with contextlib.suppress(AttributeError, TypeError):
            setattr(options, attribute, value)
    return dist.ProcessGroupNCCL(store, rank, size, options)


#: dedicated groups built so far, per tuple of global ranks (the members of a group count alike)
_DEDICATED_GROUPS: dict[tuple[int, ...], int] = {}


def _dedicated_collectives(base: dist.ProcessGroup | None, timeout: timedelta | None) -> _Collectives:
    """A process group with the ranks of ``base`` that only this package uses (see the module docstring)."""
    backend = str(dist.get_backend(base))
    ranks = dist.get_process_group_ranks(base if base is not None else dist.group.WORLD)
    serial = _DEDICATED_GROUPS[tuple(ranks)] = _DEDICATED_GROUPS.get(tuple(ranks), 0) + 1
    timeout = timeout or _group_timeout(base) or timedelta(minutes=30)
    prefix = "hf_zeroone/{}/{}/{}/{}".format(
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        serial,
        "-".join(map(str, ranks)),
    )
    rank, size = dist.get_rank(base), dist.get_world_size(base)
    if backend in ("gloo", "nccl"):
        store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        return _Collectives(_backend_object(backend, store, rank, size, timeout, prefix), raw=True, backend=backend)
    # Other backends: a registered group that only its members create.
    group = dist.new_group(
        ranks=None if base is None else ranks, timeout=timeout, use_local_synchronization=base is not None
    )
    return _Collectives(group, raw=False, backend=backend)
