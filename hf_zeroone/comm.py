"""Collectives over a ``torch.distributed`` process group: exact and error-compensated 1-bit allreduce.

:class:`Communicator` averages tensors over the ranks of a group, exactly (a full-precision
allreduce) or with the two-stage 1-bit compressed allreduce of 1-bit Adam and 0/1 Adam (the
arithmetic is in :mod:`hf_zeroone._two_stage`: two collectives per call, about 1/32 of an fp32
allreduce's bytes), and counts exactly what this rank sends (:class:`CommStats`). Either kind of
call can carry an *exact lane*, a short float32 vector averaged exactly in the same collectives
(per-tensor norms and samples, mask flags): what the optimizers need beside a message costs no
collective of its own.

All collectives are issued, in submission order, by one background thread per
:class:`Communicator` on a process group the package uses for nothing else (built only by the
group's members, so data-parallel sub-groups work). The DDP hook can therefore return futures
while backward goes on, and no collective is ever issued from inside a future callback (with
gloo, a blocking collective inside a ``.then`` callback deadlocks once there are two buckets).
Collectives run under the process group's timeout, so a missing rank ends in an error, not a
hang. On CUDA the jobs run on a stream of the communicator's own, ordered after the caller's
stream by an event, the futures are CUDA-aware (:mod:`hf_zeroone._executor`), and a call's
operations are replayed from CUDA graphs (:mod:`hf_zeroone._graphs`): no host read of a device
value happens per call (a non-finite input is handled by ``where`` and NaN propagation).
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from hf_zeroone._accounting import CommStats, fp32_allreduce_bytes
from hf_zeroone._executor import (
    _Collectives,
    _dedicated_collectives,
    _LoopbackCollectives,
    _SerialExecutor,
    collective_device,
    stop_all_workers,
)
from hf_zeroone._graphs import GraphedJobs, graphs_enabled
from hf_zeroone._tensors import bit_checksum
from hf_zeroone._two_stage import SCALE_BYTES, compressed_allreduce, float8_allreduce, float8_row_bytes, lane_floats
from hf_zeroone.compression import ChunkLayout

__all__ = ["CommStats", "Communicator", "bit_checksum", "fp32_allreduce_bytes"]


_LIVE_COMMUNICATORS: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def _close_communicators_at_exit() -> None:
    for comm in list(_LIVE_COMMUNICATORS):
        comm.close()
    stop_all_workers(timeout=10.0)  # the workers of communicators that were garbage-collected


def _stop_worker_when_collected(comm: Communicator, executor: _SerialExecutor) -> None:
    """Stop ``executor``'s thread once ``comm`` is garbage-collected (a dropped optimizer leaks no thread)."""
    weakref.finalize(comm, executor.shutdown).atexit = False  # at exit the handler above stops it


class Communicator:
    """Exact and 1-bit compressed allreduce over a process group, with byte accounting.

    Args:
        process_group: the data-parallel group. ``None`` means the default group when
            ``torch.distributed`` is initialised, and a single-process communicator otherwise.
        dedicated: create a new process group with the same ranks for the package's own
            collectives (the default). Every rank of ``process_group`` must construct its
            communicators in the same order. Pass ``False`` only when ``process_group`` is already
            reserved for this communicator.
        timeout: timeout of the dedicated group; defaults to the timeout of ``process_group``.

    ``world_size == 1`` (or no initialised process group) makes every call a local no-op that
    sends nothing.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        dedicated: bool = True,
        timeout: timedelta | None = None,
    ) -> None:
        self.stats = CommStats()
        self._executor: _SerialExecutor | None = None
        self._graphs: GraphedJobs | None = None
        self._coll: _Collectives | None = None
        self._closed = False
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None:
                raise ValueError("process_group was given but torch.distributed is not initialized")
            self.world_size, self.rank = 1, 0
            return
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if self.world_size == 1:
            return
        if dedicated:
            self._coll = _dedicated_collectives(process_group, timeout)
        else:
            group = process_group if process_group is not None else dist.group.WORLD
            self._coll = _Collectives(group, raw=False, backend=str(dist.get_backend(group)))
        self._executor = _SerialExecutor(f"hf_zeroone-comm-rank{self.rank}")
        self._graphs = GraphedJobs() if graphs_enabled() else None
        _stop_worker_when_collected(self, self._executor)
        _LIVE_COMMUNICATORS.add(self)

    @classmethod
    def local(cls) -> Communicator:
        """A single-process communicator even when ``torch.distributed`` is initialised (sends nothing)."""
        comm = cls.__new__(cls)
        comm.stats, comm._executor, comm._coll, comm._closed, comm._graphs = CommStats(), None, None, False, None
        comm.world_size, comm.rank = 1, 0
        return comm

    @classmethod
    def _loopback(cls, world_size: int, rank: int = 0, threaded: bool = True) -> Communicator:
        """One process standing in for ``world_size`` ranks that all send what this one sends.

        Runs the whole arithmetic of a ``world_size``-rank compressed allreduce, on the worker
        thread and its CUDA stream when ``threaded``, without a process group: for benchmarks
        and single-device tests (see :class:`~hf_zeroone._executor._LoopbackCollectives`).
        """
        comm = cls.__new__(cls)
        comm.stats, comm._closed = CommStats(), False
        comm.world_size, comm.rank = world_size, rank
        comm._coll = _LoopbackCollectives(rank, world_size)
        comm._graphs = GraphedJobs() if graphs_enabled() else None
        comm._executor = _SerialExecutor(f"hf_zeroone-loopback-rank{rank}") if threaded else None
        if comm._executor is not None:
            _stop_worker_when_collected(comm, comm._executor)
            _LIVE_COMMUNICATORS.add(comm)
        return comm

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------ scheduling
    def _job(self, key: tuple, job: Callable[..., Tensor], tensors: tuple[Tensor, ...], of: tuple = ()) -> Callable:
        """``job(collectives, *tensors)`` as a job; on a GPU, replayed from CUDA graphs (:mod:`hf_zeroone._graphs`)."""
        coll, graphs = self._coll, self._graphs
        if graphs is None or not tensors[0].is_cuda:
            return lambda: job(coll, *tensors)
        return lambda: graphs.run((*key, tensors[0].device, *(t.shape for t in tensors)), job, coll, tensors, of)

    def _submit(self, job: Callable[[], Tensor], tensors: Sequence[Tensor] = ()) -> torch.futures.Future:
        """Run ``job`` on the worker, in order, or inline on the caller's stream; ``tensors``: its inputs."""
        if self._closed:
            raise RuntimeError("this hf_zeroone Communicator was closed; create a new one (or a new optimizer)")
        if self._executor is None or self._executor.on_worker_thread():  # nested call: inline, keeps the order
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(job())
            return fut
        return self._executor.submit(job, tensors)

    @property
    def failure(self) -> BaseException | None:
        """The exception of the communication job that stopped this communicator, if one did."""
        return None if self._executor is None else self._executor.failure

    def close(self) -> None:
        """Stop the background thread and release the dedicated process group.

        Called for every live communicator at interpreter exit, so that no gloo group is torn
        down after the interpreter (gloo's threads then abort the process).
        """
        if self._executor is not None:
            self._executor.shutdown(timeout=10.0)
            self._executor = None
        if self._coll is not None:
            self._coll.close()
            self._coll = None
            self._closed = True

    # ------------------------------------------------------------------ exact allreduce
    def allreduce_mean_async(
        self, tensor: Tensor, exact: Tensor | None = None, lane_in_bf16: bool = False
    ) -> torch.futures.Future:
        """Average ``tensor`` over ranks in place, in its own dtype; the future yields ``tensor``.

        ``exact``: a lane of float32 values (flat), averaged in place in the same collective when
        ``tensor`` is float32 too; beside a tensor of another dtype it goes in a second
        collective, in float32 (a lane of norms must not overflow fp16). ``lane_in_bf16``: beside
        a bfloat16 tensor, the lane rides in its collective rounded to bf16 instead (an exact step
        sent in bf16 because the optimizer's ``exact_step_dtype`` asks for it).
        """
        if not self.is_distributed:
            return self._submit(lambda: tensor)
        if not tensor.is_contiguous():
            raise ValueError("allreduce_mean_async needs a contiguous tensor (gloo is wrong on views)")
        rides_in_bf16 = lane_in_bf16 and tensor.dtype == torch.bfloat16
        if exact is not None and tensor.dtype != exact.dtype and not rides_in_bf16:
            self.allreduce_mean_async(exact)
            exact = None
        n, lane = tensor.numel(), 0 if exact is None else exact.numel()
        self.stats.bytes_sent += fp32_allreduce_bytes(n + lane, self.world_size, tensor.element_size())
        self.stats.fp32_equivalent_bytes += fp32_allreduce_bytes(n + lane, self.world_size)
        self.stats.collectives += 1
        self.stats.full_allreduces += 1
        coll, world = self._coll, self.world_size

        def job() -> Tensor:
            both = tensor if exact is None else torch.cat([tensor.reshape(-1), exact.reshape(-1).to(tensor.dtype)])
            both.div_(world)  # before the sum, as DDP does: an fp16 sum of P values could overflow
            coll.all_reduce_sum(both)
            if exact is not None:
                tensor.copy_(both[:n].view_as(tensor))
                exact.copy_(both[n:].view_as(exact))
            return tensor

        return self._submit(job, (tensor,) if exact is None else (tensor, exact))

    def allreduce_mean(self, tensor: Tensor, exact: Tensor | None = None, lane_in_bf16: bool = False) -> Tensor:
        """Blocking form of :meth:`allreduce_mean_async`."""
        return self.allreduce_mean_async(tensor, exact, lane_in_bf16).wait()

    # ------------------------------------------------------------------ consistency
    def assert_identical(self, tensors: list[Tensor], what: str = "parameters", step: int | None = None) -> None:
        """Raise ``RuntimeError`` on every rank if ``tensors`` differ in any bit between ranks.

        Compares an exact integer checksum of the bit patterns (two int64 per rank, one
        all-gather), so it costs one tiny collective whatever the model size. The checksum is
        computed on the tensors' device and gathered where the backend takes it (a CUDA device
        for NCCL, the CPU for gloo); one host read at the end. ``step``: each rank's step counter,
        gathered beside the checksum (one more int64) and compared too; the error names each
        rank's where they differ. Counted in ``stats.check_bytes`` and ``stats.check_collectives``,
        apart from the training's traffic.
        """
        if not self.is_distributed:
            return
        home = tensors[0].device if tensors else torch.device("cpu")
        local = bit_checksum(tensors, device=collective_device(self._coll.backend, home))
        if step is not None:
            local = torch.cat([local, torch.tensor([step], dtype=torch.int64, device=local.device)])
        self.stats.check_bytes += (self.world_size - 1) * local.numel() * local.element_size()
        self.stats.check_collectives += 1
        rows = self._gather_rows(local)
        if not bool((rows == rows[0]).all()):
            differing = [r for r in range(self.world_size) if not torch.equal(rows[r], rows[0])]
            steps = rows[:, 2].tolist() if step is not None else []
            behind = (
                " Their step counters differ (" + ", ".join(f"rank {r} at {s}" for r, s in enumerate(steps)) + "): "
                "a rank skipped a step() that the others took."
                if len(set(steps)) > 1
                else ""
            )
            raise RuntimeError(
                f"hf_zeroone: {what} differ between ranks (ranks {differing} disagree with rank 0).{behind} Replicas "
                "drifted apart: a rank stepped differently (a step() skipped after backward() on one rank only, "
                "weights changed on one rank, ranks on CPUs or GPUs whose kernels round differently, or a bug). "
                "Restart from the last checkpoint with every rank calling step() alike; report it if it repeats. "
                "The check is check_replicas_every (0 turns it off, leaving the replicas to differ)."
            )

    def gather_setup(self, values: Tensor, home: torch.device | None = None) -> Tensor:
        """Every rank's ``values`` (a short 1-D float64 vector, as long on every rank), as rows in rank order.

        One all-gather, for checks before training that the ranks agree
        (:mod:`hf_zeroone.optim._agreement`); counted in ``stats.setup_bytes`` and
        ``stats.setup_collectives``, apart from the training's traffic. ``home``: the device of the
        tensors the caller trains (NCCL gathers on it; default: ``values``' own). One rank: its own row.
        """
        if values.dim() != 1 or values.dtype != torch.float64:
            raise ValueError(f"gather_setup takes a 1-D float64 tensor, got {values.dtype} {tuple(values.shape)}")
        if not self.is_distributed:
            return values.reshape(1, -1).clone()
        device = collective_device(self._coll.backend, values.device if home is None else torch.device(home))
        local = values.to(device).contiguous()
        self.stats.setup_bytes += (self.world_size - 1) * local.numel() * local.element_size()
        self.stats.setup_collectives += 1
        return self._gather_rows(local)

    def _gather_rows(self, local: Tensor) -> Tensor:
        """Every rank's ``local`` (1-D, on the backend's device) as rows in rank order, on the CPU: one all-gather."""
        gathered = torch.empty(self.world_size, local.numel(), dtype=local.dtype, device=local.device)
        coll = self._coll

        def job() -> Tensor:
            coll.all_gather(list(gathered.unbind(0)), local)
            return gathered

        return self._submit(job, (local, gathered)).wait().cpu()

    def float8_allreduce_async(
        self, tensor: Tensor, sizes: Sequence[int] | None = None, exact: Tensor | None = None
    ) -> torch.futures.Future:
        """Average float32 ``tensor`` over ranks in place, sent as float8 messages; the future yields ``tensor``.

        Two collectives (an all-to-all and an all-gather, see :func:`hf_zeroone._two_stage.float8_allreduce`)
        that send about half a bf16 allreduce's bytes; the result, identical on every rank, is each
        gradient's mean rounded twice to 3 bits of mantissa. ``sizes``: the element counts of the
        pieces ``tensor`` holds end to end (a bucket's parameters; default: one piece), each
        encoded in blocks of its own. ``exact``: a float32 lane averaged exactly in the same
        collectives. One rank: nothing is sent and ``tensor`` is kept as it is.
        """
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"float8_allreduce_async needs a contiguous float32 tensor, got {tensor.dtype}")
        if exact is not None and (exact.dtype != torch.float32 or not exact.is_contiguous()):
            raise ValueError(f"exact must be a contiguous float32 tensor, got {exact.dtype}")
        sizes = [tensor.numel()] if sizes is None else list(sizes)
        if sum(sizes) != tensor.numel() or min(sizes, default=0) < 0:
            raise ValueError(f"sizes must be counts that add up to the tensor's {tensor.numel()} elements")
        if not self.is_distributed:
            return self._submit(lambda: tensor)
        p, lane = self.world_size, 0 if exact is None else exact.numel()
        self.stats.bytes_sent += 2 * (p - 1) * float8_row_bytes(sizes, lane, p)
        self.stats.fp32_equivalent_bytes += fp32_allreduce_bytes(tensor.numel() + lane, p)
        self.stats.collectives += 2
        self.stats.full_allreduces += 1
        rank, inputs = self.rank, (tensor,) if exact is None else (tensor, exact)

        def job(coll: object, t: Tensor, lane_: Tensor | None = None) -> Tensor:
            return float8_allreduce(coll, rank, p, t, sizes, lane_)

        return self._submit(self._job(("float8", tuple(sizes), rank, p), job, inputs), inputs)

    # ------------------------------------------------------------------ 1-bit allreduce
    def compressed_allreduce_async(
        self,
        buffer: Tensor,
        worker_error: Tensor,
        server_error: Tensor,
        layout: ChunkLayout,
        exact: Tensor | None = None,
    ) -> torch.futures.Future:
        """Error-compensated 1-bit average of ``buffer`` over ranks (see :mod:`hf_zeroone._two_stage`).

        Args:
            buffer: float32, ``layout.padded`` elements; used as scratch (its content is lost).
            worker_error: float32, ``layout.padded`` elements; updated in place.
            server_error: float32, ``layout.chunk`` elements, this rank's chunk; updated in place.
            layout: the padding, chunking and mask; must be identical on every rank.
            exact: an exact lane (float32, flat, the same length on every rank), averaged over ranks
                in place, exactly, in the same two collectives.

        Returns:
            A future of a float32 tensor of ``layout.padded`` elements, written into ``buffer``'s
            memory (views of ``buffer`` see it), identical on every rank, zero on masked elements,
            all NaN if any rank's input was not finite.
        """
        self._check_compressed_args(buffer, worker_error, server_error, layout)
        if exact is not None and (exact.dtype != torch.float32 or not exact.is_contiguous()):
            raise ValueError(f"exact must be a contiguous float32 tensor, got {exact.dtype}")
        if not self.is_distributed:
            # One rank: nothing to average, nothing to compress.
            return self._submit(lambda: buffer.mul_(layout.mask))
        if layout.padded == 0:
            if exact is not None:
                self.allreduce_mean_async(exact)
            return self._submit(lambda: buffer)
        lane = 0 if exact is None else exact.numel()
        p = self.world_size
        w = layout.chunk_bytes + SCALE_BYTES * (layout.segments_per_chunk + lane_floats(lane, p))
        self.stats.bytes_sent += 2 * (p - 1) * w
        self.stats.fp32_equivalent_bytes += fp32_allreduce_bytes(layout.numel + lane, p)
        self.stats.collectives += 2
        self.stats.compressed_allreduces += 1
        rank, own = self.rank, (buffer,) if exact is None else (buffer, exact)
        inputs = (buffer, worker_error, server_error, *layout.tensors(), *own[1:])

        def job(coll: object, b: Tensor, lane_: Tensor | None = None) -> Tensor:
            return compressed_allreduce(coll, rank, p, b, worker_error, server_error, layout, lane_)

        key = ("1-bit", rank, p, worker_error.data_ptr(), server_error.data_ptr(), layout.padded)
        return self._submit(self._job(key, job, own, of=(layout,)), inputs)

    def compressed_allreduce(
        self,
        buffer: Tensor,
        worker_error: Tensor,
        server_error: Tensor,
        layout: ChunkLayout,
        exact: Tensor | None = None,
    ) -> Tensor:
        """Blocking form of :meth:`compressed_allreduce_async`."""
        return self.compressed_allreduce_async(buffer, worker_error, server_error, layout, exact).wait()

    def _check_compressed_args(
        self, buffer: Tensor, worker_error: Tensor, server_error: Tensor, layout: ChunkLayout
    ) -> None:
        if layout.world_size != self.world_size:
            raise ValueError(f"layout was built for world_size={layout.world_size}, the group has {self.world_size}")
        for name, t, n in (
            ("buffer", buffer, layout.padded),
            ("worker_error", worker_error, layout.padded),
            ("server_error", server_error, layout.chunk),
        ):
            if t.dtype != torch.float32 or t.numel() != n or not t.is_contiguous():
                raise ValueError(
                    f"{name} must be a contiguous float32 tensor of {n} elements, "
                    f"got {t.dtype} with {t.numel()} elements"
                )
