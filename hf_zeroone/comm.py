"""Collectives over a ``torch.distributed`` process group: exact and error-compensated 1-bit allreduce.

Two-stage compressed allreduce (1-bit Adam, Tang et al. 2021, https://arxiv.org/abs/2102.02888,
Algorithm 1; 0/1 Adam, Lu et al. 2023, https://arxiv.org/abs/2202.06009). For ``P`` ranks and a
flat vector padded to ``P`` chunks of ``c`` elements (:class:`~hf_zeroone.compression.ChunkLayout`):

1. worker ``i``: ``y = x_i + e_w``; every segment ``s`` of ``y`` (a piece of one packed tensor
   inside one chunk, see :class:`~hf_zeroone.compression.ChunkLayout`) is compressed to
   ``C[y_s] = scale_s * sign(y_s)`` with ``scale_s = ||y_s|| / sqrt(n_s)``; ``e_w <- y - C[y]``.
2. one ``all_to_all``: chunk ``k`` of every worker's packed signs, with its segment scales, goes
   to rank ``k``.
3. rank ``k`` (server of chunk ``k``): ``z = mean_i C[y_ik] + e_s``, compressed the same way
   with its own segment scales; ``e_s <- z - C[z]``.
4. one ``all_gather`` of every server's packed signs and scales; every rank decompresses the same
   bytes, so the result is bit-identical on all ranks.

Per rank this sends ``2 (P-1)/P * n/8`` bytes of signs plus ``2 (P-1) S`` four-byte scales
(``S`` segments per chunk), against ``2 (P-1)/P * 4n`` for an fp32 ring allreduce: the floor is
1/32. The paper uses one scale per worker vector; per-segment scales cost a few hundred bytes per
call and keep each tensor's own magnitude (with one scale per chunk, 0/1 Adam diverged on a small
MLP whose layers have very different gradient scales; with per-segment scales it tracks AdamW).

Non-finite input on any rank makes the result NaN on *every* rank (each worker marks all its
scales NaN, so every server sees it) and leaves both error buffers unchanged: a NaN never enters
error feedback, and all ranks agree that the step is bad.

All collectives are issued, in submission order, by one background thread per
:class:`Communicator` on a process group the package uses for nothing else. The DDP hook can
therefore return futures while backward goes on, and no collective is ever issued from inside a
future callback (with gloo, a blocking collective inside a ``.then`` callback deadlocks once there
are two buckets). Collectives run under the process group's timeout, so a missing rank ends in an
error, not a hang.
"""

from __future__ import annotations

import atexit
import math
import os
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hf_zeroone.compression import ChunkLayout, compression_error, decompress, pack_signs, segment_scales

__all__ = ["CommStats", "Communicator", "bit_checksum", "fp32_allreduce_bytes"]

_SCALE_BYTES = 4  # one float32


def fp32_allreduce_bytes(numel: int, world_size: int, element_size: int = 4) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements: ``2 (P-1)/P * size``."""
    if world_size <= 1:
        return 0
    return math.ceil(2 * (world_size - 1) * numel * element_size / world_size)


def bit_checksum(tensors: list[Tensor]) -> Tensor:
    """Two int64 sums of the tensors' bit patterns (plain and position-weighted): equal iff bit-equal.

    Exact integer arithmetic, so any flipped bit changes it (up to astronomically unlikely
    collisions); the weighted sum also catches tensors that swapped places.
    """
    total = torch.zeros(2, dtype=torch.int64)
    for i, t in enumerate(tensors):
        t = t.detach().contiguous().reshape(-1)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        s = t.view(bits).to(torch.int64).sum().cpu()
        total[0] += s
        total[1] += s * (i + 1)
    return total


@dataclass
class CommStats:
    """What one rank sent: bytes, collective calls, and allreduces of each kind.

    Counted exactly when each collective is issued (the payload this rank puts on the wire under
    a ring / pairwise model: ``(P-1) * w`` for an all-to-all or all-gather of ``w`` bytes per
    peer, ``2 (P-1)/P * b`` for an allreduce of ``b`` bytes). ``fp32_equivalent_bytes`` is what
    an fp32 ring allreduce of the same elements would have sent, for compression ratios.
    """

    bytes_sent: int = 0
    collectives: int = 0
    full_allreduces: int = 0
    compressed_allreduces: int = 0
    fp32_equivalent_bytes: int = 0

    def copy(self) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def compression_ratio(self) -> float:
        """fp32-equivalent bytes divided by bytes actually sent (``inf`` when nothing was sent)."""
        return self.fp32_equivalent_bytes / self.bytes_sent if self.bytes_sent else math.inf

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _SerialExecutor:
    """Runs submitted jobs one at a time, in order, on a daemon thread; results come as futures."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], torch.futures.Future] | None] = queue.SimpleQueue()
        #: the exception of the first job that failed; after it no job runs (see :meth:`refusal`)
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

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

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut = item
            if self.failure is not None:
                # A failed job may have stopped between two collectives: running later jobs would
                # pair this rank's collectives with different ones on the other ranks.
                fut.set_exception(self.refusal())
                continue
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                self.failure = exc
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            # Not kept until the next job arrives: the finished job's inputs (a message) and result.
            item = job = fut = result = None

    def on_worker_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, job: Callable[[], Any]) -> torch.futures.Future:
        if self.failure is not None:
            raise self.refusal()
        fut: torch.futures.Future = torch.futures.Future()
        self._jobs.put((job, fut))
        return fut

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop after the jobs already submitted; wait up to ``timeout`` seconds for the thread."""
        self._jobs.put(None)
        if timeout is not None and not self.on_worker_thread():
            self._thread.join(timeout)


class _Collectives:
    """The three collectives the package needs, on a registered process group or a private one.

    The dedicated group is built directly on the default store under a prefix unique to this
    launch attempt (torchelastic run id and restart count) and communicator. ``dist.new_group``
    would reuse the same store keys after a ``torchrun --max-restarts`` restart, and a restarted
    rank could then read a dead peer's address.
    """

    def __init__(self, group: Any, raw: bool) -> None:
        self.group, self.raw = group, raw

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


_DEDICATED_GROUPS = 0


def _dedicated_collectives(base: dist.ProcessGroup | None, timeout: timedelta | None) -> _Collectives:
    """A process group with the ranks of ``base`` that only this package uses."""
    global _DEDICATED_GROUPS
    _DEDICATED_GROUPS += 1
    backend = dist.get_backend(base)
    ranks = dist.get_process_group_ranks(base if base is not None else dist.group.WORLD)
    timeout = timeout or _group_timeout(base) or timedelta(minutes=30)
    prefix = "hf_zeroone/{}/{}/{}/{}".format(
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        _DEDICATED_GROUPS,
        "-".join(map(str, ranks)),
    )
    rank, size = dist.get_rank(base), dist.get_world_size(base)
    if backend == "gloo":
        store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        return _Collectives(dist.ProcessGroupGloo(store, rank, size, timeout), raw=True)
    # Other backends (NCCL): a regular new group.
    return _Collectives(dist.new_group(ranks=None if base is None else ranks, timeout=timeout), raw=False)


def _zero_masked(t: Tensor, layout: ChunkLayout, start: int = 0) -> None:
    """Zero the masked elements of flat ``t``, which holds layout positions ``start ..``.

    Without caller masks only the padding at the end is masked: zero that tail instead of
    multiplying the whole vector by the mask (one pass over the data saved, five times a call).
    """
    if layout.fully_unmasked:
        first_pad = layout.numel - start
        if first_pad < t.numel():
            t[max(first_pad, 0) :].zero_()
    else:
        t.mul_(layout.mask[start : start + t.numel()])


def _group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout of ``group`` (default group if ``None``), or ``None`` if it cannot be read."""
    pg = group if group is not None else dist.group.WORLD
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return pg._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001 - private API, best effort
            continue
    return None


_LIVE_COMMUNICATORS: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def _close_communicators_at_exit() -> None:
    for comm in list(_LIVE_COMMUNICATORS):
        comm.close()


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
            self._coll = _Collectives(process_group if process_group is not None else dist.group.WORLD, raw=False)
        self._executor = _SerialExecutor(f"hf_zeroone-comm-rank{self.rank}")
        _LIVE_COMMUNICATORS.add(self)

    @classmethod
    def local(cls) -> Communicator:
        """A single-process communicator even when ``torch.distributed`` is initialised (sends nothing)."""
        comm = cls.__new__(cls)
        comm.stats, comm._executor, comm._coll, comm._closed = CommStats(), None, None, False
        comm.world_size, comm.rank = 1, 0
        return comm

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------ scheduling
    def _submit(self, job: Callable[[], Tensor]) -> torch.futures.Future:
        if self._closed:
            raise RuntimeError("this hf_zeroone Communicator was closed; create a new one (or a new optimizer)")
        if self._executor is None:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(job())
            return fut
        if self._executor.on_worker_thread():  # nested call: run inline, keep the order
            fut = torch.futures.Future()
            fut.set_result(job())
            return fut
        return self._executor.submit(job)

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
            self._coll = None
            self._closed = True

    # ------------------------------------------------------------------ exact allreduce
    def allreduce_mean_async(self, tensor: Tensor) -> torch.futures.Future:
        """Average ``tensor`` over ranks in place (full precision); the future yields ``tensor``."""
        if not self.is_distributed:
            return self._submit(lambda: tensor)
        if not tensor.is_contiguous():
            raise ValueError("allreduce_mean_async needs a contiguous tensor (gloo is wrong on views)")
        self.stats.bytes_sent += fp32_allreduce_bytes(tensor.numel(), self.world_size, tensor.element_size())
        self.stats.fp32_equivalent_bytes += fp32_allreduce_bytes(tensor.numel(), self.world_size)
        self.stats.collectives += 1
        self.stats.full_allreduces += 1
        coll, world = self._coll, self.world_size

        def job() -> Tensor:
            tensor.div_(world)  # before the sum, as DDP does: an fp16 sum of P values could overflow
            coll.all_reduce_sum(tensor)
            return tensor

        return self._submit(job)

    def allreduce_mean(self, tensor: Tensor) -> Tensor:
        """Blocking form of :meth:`allreduce_mean_async`."""
        return self.allreduce_mean_async(tensor).wait()

    # ------------------------------------------------------------------ consistency
    def assert_identical(self, tensors: list[Tensor], what: str = "parameters") -> None:
        """Raise ``RuntimeError`` on every rank if ``tensors`` differ in any bit between ranks.

        Compares an exact integer checksum of the bit patterns (two int64 per rank, one
        all-gather), so it costs one tiny collective whatever the model size.
        """
        if not self.is_distributed:
            return
        local = bit_checksum(tensors)
        gathered = torch.empty(self.world_size, local.numel(), dtype=local.dtype)
        self.stats.bytes_sent += (self.world_size - 1) * local.numel() * local.element_size()
        self.stats.collectives += 1
        coll = self._coll

        def job() -> Tensor:
            coll.all_gather(list(gathered.unbind(0)), local)
            return gathered

        rows = self._submit(job).wait()
        if not bool((rows == rows[0]).all()):
            differing = [r for r in range(self.world_size) if not torch.equal(rows[r], rows[0])]
            raise RuntimeError(
                f"hf_zeroone: {what} differ between ranks (ranks {differing} disagree with rank 0). Replicas "
                "drifted apart: a rank stepped differently (a skipped step on one rank, non-deterministic "
                "kernels, or a bug). Stop and restart from the last checkpoint; report it if it repeats."
            )

    # ------------------------------------------------------------------ 1-bit allreduce
    def compressed_allreduce_async(
        self,
        buffer: Tensor,
        worker_error: Tensor,
        server_error: Tensor,
        layout: ChunkLayout,
    ) -> torch.futures.Future:
        """Error-compensated 1-bit average of ``buffer`` over ranks (see the module docstring).

        Args:
            buffer: float32, ``layout.padded`` elements; used as scratch (its content is lost).
            worker_error: float32, ``layout.padded`` elements; updated in place.
            server_error: float32, ``layout.chunk`` elements, this rank's chunk; updated in place.
            layout: the padding, chunking and mask; must be identical on every rank.

        Returns:
            A future of a new float32 tensor of ``layout.padded`` elements, identical on every
            rank, zero on masked elements, all NaN if any rank's input was not finite.
        """
        self._check_compressed_args(buffer, worker_error, server_error, layout)
        if layout.padded == 0:
            return self._submit(lambda: buffer.new_zeros(0))
        if not self.is_distributed:
            # One rank: nothing to average, nothing to compress.
            return self._submit(lambda: buffer * layout.mask)
        p, w = self.world_size, layout.chunk_bytes + _SCALE_BYTES * layout.segments_per_chunk
        self.stats.bytes_sent += 2 * (p - 1) * w
        self.stats.fp32_equivalent_bytes += fp32_allreduce_bytes(layout.numel, p)
        self.stats.collectives += 2
        self.stats.compressed_allreduces += 1
        return self._submit(lambda: self._compressed_allreduce(buffer, worker_error, server_error, layout))

    def compressed_allreduce(
        self, buffer: Tensor, worker_error: Tensor, server_error: Tensor, layout: ChunkLayout
    ) -> Tensor:
        """Blocking form of :meth:`compressed_allreduce_async`."""
        return self.compressed_allreduce_async(buffer, worker_error, server_error, layout).wait()

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

    def _compressed_allreduce(
        self, buffer: Tensor, worker_error: Tensor, server_error: Tensor, layout: ChunkLayout
    ) -> Tensor:
        p, c, nb, k = self.world_size, layout.chunk, layout.chunk_bytes, self.rank
        s_per = layout.segments_per_chunk
        sb = _SCALE_BYTES * s_per
        device = buffer.device

        # Stage 1, worker side: y = x + e_w, compressed segment by segment.
        y = buffer
        y.add_(worker_error)
        _zero_masked(y, layout)
        scales = segment_scales(y, layout.bounds, layout.segment_counts)
        if not bool(torch.isfinite(scales).all()):
            scales.fill_(math.nan)  # every server will see it
        send = torch.empty(p, nb + sb, dtype=torch.uint8, device=device)
        send[:, :nb] = pack_signs(y.view(p, c))
        send[:, nb:] = scales.view(torch.uint8).view(p, sb)
        recv = torch.empty_like(send)
        self._coll.all_to_all(recv, send)
        # worker_scales[i, j]: scale of segment j of my chunk, as worker i compressed it
        worker_scales = recv[:, nb:].contiguous().view(torch.float32).view(p, s_per)
        finite = bool(torch.isfinite(worker_scales).all())
        if finite:  # e_w <- y - C[y]; never absorbs a non-finite value
            compression_error(y, scales, layout.bounds, out=worker_error)
            _zero_masked(worker_error, layout)

        # Stage 1, server side: average the P compressed copies of my chunk, compress again.
        out_row = torch.empty(nb + sb, dtype=torch.uint8, device=device)
        bounds = layout.chunk_bounds(k)
        if finite:
            # the P copies side by side, each scaled by 1/P, then summed: z = mean_i C[y_ik] + e_s
            copies = decompress(recv[:, :nb], worker_scales.reshape(-1) / p, _tile(bounds, p)).view(p, c)
            z = torch.add(copies[0], server_error)
            for i in range(1, p):  # row by row: much faster than a sum over dim 0 on CPU
                z.add_(copies[i])
            _zero_masked(z, layout, start=k * c)
            s = segment_scales(z, bounds, layout.chunk_segment_counts(k))
            out_row[:nb] = pack_signs(z)
            compression_error(z, s, bounds, out=server_error)
            _zero_masked(server_error, layout, start=k * c)
        else:
            s = torch.full((s_per,), math.nan, dtype=torch.float32, device=device)
            out_row[:nb] = 0
        out_row[nb:] = s.view(torch.uint8)

        # Stage 2: every rank gets every server's chunk and decompresses the same bytes.
        gathered = torch.empty(p, nb + sb, dtype=torch.uint8, device=device)
        self._coll.all_gather(list(gathered.unbind(0)), out_row)
        server_scales = gathered[:, nb:].contiguous().view(torch.float32).view(-1)
        result = decompress(gathered[:, :nb], server_scales, layout.bounds)
        if finite:
            _zero_masked(result, layout)
        return result


def _tile(bounds: tuple[int, ...], times: int) -> tuple[int, ...]:
    """Segment bounds of ``times`` copies of a vector laid end to end."""
    length = bounds[-1]
    return tuple(i * length + b for i in range(times) for b in bounds[:-1]) + (times * length,)
