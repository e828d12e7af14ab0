"""The two-stage compressed allreduce, as one rank computes it (collectives through an injected object).

1-bit Adam (Tang et al. 2021, https://arxiv.org/abs/2102.02888, Algorithm 1) and 0/1 Adam (Lu et
al. 2023, https://arxiv.org/abs/2202.06009). For ``P`` ranks and a flat vector padded to ``P``
chunks of ``c`` elements (:class:`~hf_zeroone.compression.ChunkLayout`):

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
call and keep each tensor's own magnitude (with one scale per chunk, the tensors with the largest
gradients set every element's magnitude, which can make a model whose layers have very different
gradient scales diverge).

**The exact lane.** A call may carry a short float32 vector ``exact`` that is averaged exactly,
not compressed (per-tensor squared norms, scale samples, mask flags): chunk ``k`` of it rides to
rank ``k`` in the all-to-all beside the signs, rank ``k`` averages its chunk (each copy divided by
``P``, then summed in rank order, as an allreduce of ``P = 2`` ranks does), and the averaged chunks
come back in the all-gather. Its bytes are those of an fp32 ring allreduce of the vector, and it
costs no collective of its own: a 1-bit call stays at two collectives whatever it carries.

Non-finite input on any rank makes the result NaN on *every* rank (each worker marks all its
scales NaN, so every server sees it) and leaves both error buffers unchanged: a NaN never enters
error feedback, and all ranks agree that the step is bad. No host read of a device value happens
per call: the non-finite case is handled by ``where`` and NaN propagation on the device, with
exactly the results a branch on the host would give.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hf_zeroone.compression import ChunkLayout, compression_error, decompress, pack_signs, segment_scales
from hf_zeroone.float8 import FLOAT8_BLOCK, decode_float8, encode_float8_into

__all__ = ["SCALE_BYTES", "compressed_allreduce", "float8_allreduce", "float8_row_bytes", "lane_floats"]

SCALE_BYTES = 4  # one float32


def lane_floats(length: int, world_size: int) -> int:
    """Floats of an exact lane of ``length`` that each chunk carries (the lane padded to ``P`` chunks)."""
    return -(-length // world_size)


def float8_row_bytes(sizes: Sequence[int], lane: int, world_size: int) -> int:
    """Bytes of one rank's row in :func:`float8_allreduce` of pieces of ``sizes``: codes, block exponents, lane."""
    c = _float8_chunk(sizes, world_size)
    return c + c // FLOAT8_BLOCK + SCALE_BYTES * lane_floats(lane, world_size)


def _float8_chunk(sizes: Sequence[int], world_size: int) -> int:
    """Elements per chunk of a float8 message: each piece in whole blocks, then ``P`` chunks of whole blocks."""
    blocks = sum(-(-n // FLOAT8_BLOCK) for n in sizes)
    return -(-blocks // world_size) * FLOAT8_BLOCK


def _zero_masked(t: Tensor, layout: ChunkLayout, start: int = 0, only_if: Tensor | None = None) -> None:
    """Zero the masked elements of flat ``t``, which holds layout positions ``start ..``.

    Without caller masks only the padding at the end is masked: zero that tail instead of
    multiplying the whole vector by the mask (one pass over the data saved, five times a call).
    ``only_if``: a 0-dim bool tensor; where it is false the tail is left as it is (a NaN result
    stays NaN everywhere). Multiplying by the mask keeps a NaN anyway.
    """
    if layout.fully_unmasked:
        first_pad = layout.numel - start
        if first_pad < t.numel():
            tail = t[max(first_pad, 0) :]
            if only_if is None:
                tail.zero_()
            else:
                tail.masked_fill_(only_if, 0.0)
    else:
        t.mul_(layout.mask[start : start + t.numel()])


def compressed_allreduce(
    coll: Any,  # noqa: ANN401 - the collectives (see hf_zeroone._executor)
    k: int,
    p: int,
    buffer: Tensor,
    worker_error: Tensor,
    server_error: Tensor,
    layout: ChunkLayout,
    exact: Tensor | None = None,
) -> Tensor:
    """The compressed allreduce of rank ``k`` of ``p`` (module docstring), collectives through ``coll``.

    ``exact`` (float32, flat, optional) is the exact lane: averaged over ranks in place.

    ``ok`` (all worker scales of this rank's chunk finite) stays on the device: the error buffers
    are updated through ``where(ok, new, old)``, a bad step's server scales are NaN and its signs
    zero, exactly what a host-side branch gave, without reading a device value on the host.
    """
    c, nb, s_per = layout.chunk, layout.chunk_bytes, layout.segments_per_chunk
    sb = SCALE_BYTES * s_per
    device = buffer.device
    q = 0 if exact is None else lane_floats(exact.numel(), p)
    lb = SCALE_BYTES * q  # bytes of this rank's chunk of the exact lane
    row = nb + sb + lb

    # Stage 1, worker side: y = x + e_w, compressed segment by segment.
    y = buffer
    send = torch.empty(p, row, dtype=torch.uint8, device=device)
    y.add_(worker_error)
    _zero_masked(y, layout)
    scales = segment_scales(y, layout.bounds, layout.segment_counts)
    send[:, :nb] = pack_signs(y.view(p, c))
    scales.masked_fill_(~torch.isfinite(scales).all(), math.nan)  # every server will see it
    send[:, nb : nb + sb] = scales.view(torch.uint8).view(p, sb)
    if q:
        send[:, nb + sb :] = _lane_rows(exact, p, q)
    recv = torch.empty_like(send)
    coll.all_to_all(recv, send)
    # worker_scales[i, j]: scale of segment j of my chunk, as worker i compressed it
    worker_scales = recv[:, nb : nb + sb].contiguous().view(torch.float32).view(p, s_per)
    ok = torch.isfinite(worker_scales).all()  # 0-dim, on the device; the same on every rank

    # e_w <- y - C[y], only if every worker was finite (a NaN never enters an error); after it
    # y's memory is free, and the rest of the call works in it instead of new allocations (on
    # the CPU a fresh buffer's page faults cost more than the arithmetic written into it)
    def worker_side(out: Tensor) -> None:
        _masked_error(y, scales, layout.bounds, out, layout)

    _update_error(ok, worker_error, worker_side, _scratch(y))

    # Stage 1, server side: average the P compressed copies of my chunk, compress again.
    bounds = layout.chunk_bounds(k)
    # the P copies, each scaled by 1/P, summed in rank order: z = mean_i C[y_ik] + e_s
    out_row = torch.empty(row, dtype=torch.uint8, device=device)
    scaled = worker_scales.reshape(-1) / p
    z = _server_sum(recv, nb, scaled, bounds, server_error, y.view(p, c), layout, k * c)
    s = segment_scales(z, bounds, layout.chunk_segment_counts(k))
    out_row[:nb] = pack_signs(z)
    bad = ~ok
    s.masked_fill_(bad, math.nan)
    out_row[:nb].masked_fill_(bad, 0)
    out_row[nb : nb + sb] = s.view(torch.uint8)
    if q:
        out_row[nb + sb :] = _lane_mean(recv[:, nb + sb :], p, q)

    # e_s <- z - C[z], under the same condition
    def server_side(out: Tensor) -> None:
        _masked_error(z, s, bounds, out, layout, start=k * c)

    _update_error(ok, server_error, server_side, _scratch(z))

    # Stage 2: every rank gets every server's chunk and decompresses the same bytes (into y's memory).
    gathered = torch.empty(p, row, dtype=torch.uint8, device=device)
    coll.all_gather(list(gathered.unbind(0)), out_row)
    server_scales = gathered[:, nb : nb + sb].contiguous().view(torch.float32).view(-1)
    if q:
        _lane_back(exact, gathered[:, nb + sb :])
    result = decompress(gathered[:, :nb], server_scales, layout.bounds, out=y)
    _zero_masked(result, layout, only_if=ok)  # a bad step's result stays NaN everywhere
    return result


def _server_sum(
    recv: Tensor, nb: int, scales: Tensor, bounds: tuple[int, ...], error: Tensor, into: Tensor,
    layout: ChunkLayout, start: int,
) -> Tensor:  # fmt: skip
    """``C_0 + e_s + C_1 + ... + C_{P-1}`` (rank order) from the received rows' signs, masked, in ``into[0]``.

    ``scales``: the ``P`` workers' segment scales of this chunk, already divided by ``P``, row by
    row; ``into``: ``(P, c)`` float32 scratch; the chunk starts at layout position ``start``. The
    ``P`` copies side by side, then summed row by row (much faster than a sum over dim 0 on the
    CPU), then masked.
    """
    p, c = into.shape
    copies = decompress(recv[:, :nb], scales, _tile(bounds, p), out=into.view(-1)).view_as(into)
    z = copies[0].add_(error)
    for i in range(1, p):
        z.add_(copies[i])
    _zero_masked(z, layout, start=start)
    return z


def _masked_error(
    x: Tensor, scales: Tensor, bounds: tuple[int, ...], out: Tensor, layout: ChunkLayout, start: int = 0
) -> None:
    """``out = x - C[x]`` (:func:`~hf_zeroone.compression.compression_error`), masked.

    ``x`` holds layout positions ``start ..``.
    """
    _zero_masked(compression_error(x, scales, bounds, out=out), layout, start)


def float8_allreduce(
    coll: Any,  # noqa: ANN401 - the collectives (see hf_zeroone._executor)
    k: int,
    p: int,
    buffer: Tensor,
    sizes: Sequence[int],
    exact: Tensor | None = None,
) -> Tensor:
    """Average float32 ``buffer`` (flat) over ranks in place, sent as float8 messages; rank ``k`` of ``p``.

    ``buffer`` holds pieces of ``sizes`` elements end to end (the parameters of a bucket). The two
    collectives of the 1-bit allreduce, with :func:`~hf_zeroone.float8.encode_float8` in
    place of the signs and no error feedback (an exact step keeps no state between calls):

    1. worker: each piece is zero-padded to whole blocks (so an element's rounding depends on its
       own piece only, not on the order in which a bucket packs them), the blocks are split into
       ``P`` chunks and encoded; chunk ``k`` goes to rank ``k`` in one ``all_to_all``, with its
       blocks' exponent bytes and its chunk of the lane;
    2. server ``k``: the ``P`` decoded copies are each divided by ``P`` and summed in rank order
       (as an allreduce of two ranks does), and the mean is encoded again;
    3. one ``all_gather`` of the servers' chunks; every rank decodes the same bytes, so the
       result is bit-identical on all ranks.

    Per rank about ``2 (P-1)/P * n * (1 + 1 / FLOAT8_BLOCK)`` bytes, against ``2 (P-1)/P * 2n``
    for a bf16 allreduce. Each element is rounded twice (worker, server), each time to 3 bits of
    mantissa. A non-finite element on any rank makes its block NaN on every rank. ``exact`` is
    averaged exactly in the same collectives, as in :func:`compressed_allreduce`.
    """
    c = _float8_chunk(sizes, p)
    nb, sb = c, c // FLOAT8_BLOCK  # codes, then one exponent byte per block
    q = 0 if exact is None else lane_floats(exact.numel(), p)
    row = float8_row_bytes(sizes, 0 if exact is None else exact.numel(), p)
    padded = torch.zeros(p * c, dtype=torch.float32, device=buffer.device)
    flat = buffer.reshape(-1)
    pieces = list(flat.split([*sizes, flat.numel() - sum(sizes)]))[: len(sizes)]
    torch._foreach_copy_(_blocked_pieces(padded, sizes), pieces)
    send = _float8_rows(padded, p, row)  # padded is scratch from here on: the copies, then the result
    if q:
        send[:, nb + sb :] = _lane_rows(exact, p, q)
    recv = torch.empty_like(send)
    coll.all_to_all(recv, send)
    copies = decode_float8(recv[:, :nb].reshape(-1), recv[:, nb : nb + sb].reshape(-1), out=padded)
    mean = _sum_in_rank_order(copies.view(p, c).div_(p), into_first=True)
    out_row = _float8_rows(mean, 1, row)[0]
    if q:
        out_row[nb + sb :] = _lane_mean(recv[:, nb + sb :], p, q)
    gathered = torch.empty(p, row, dtype=torch.uint8, device=buffer.device)
    coll.all_gather(list(gathered.unbind(0)), out_row)
    if q:
        _lane_back(exact, gathered[:, nb + sb :])
    result = decode_float8(gathered[:, :nb].reshape(-1), gathered[:, nb : nb + sb].reshape(-1), out=padded)
    torch._foreach_copy_(pieces, _blocked_pieces(result, sizes))
    return buffer


def _blocked_pieces(padded: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    """Views of where each piece of ``sizes`` elements lies in ``padded``, each piece padded to whole blocks.

    One split of ``padded`` into the pieces and the padding after each, not a slice per piece.
    """
    parts, end = [], 0
    for n in sizes:
        parts += [n, -n % FLOAT8_BLOCK]
        end += n + parts[-1]
    parts.append(padded.numel() - end)
    return list(padded.split(parts)[0:-1:2])


def _float8_rows(x: Tensor, rows: int, width: int) -> Tensor:
    """``rows`` rows of ``width`` bytes: each row's chunk of ``x`` encoded, codes then exponents (the rest empty).

    ``x`` is overwritten (see :func:`~hf_zeroone.float8.encode_float8_into`); the codes go
    straight into the rows.
    """
    c = x.numel() // rows
    out = torch.empty(rows, width, dtype=torch.uint8, device=x.device)
    exponents = encode_float8_into(x, out[:, :c])
    out[:, c : c + c // FLOAT8_BLOCK] = exponents.view(rows, -1)
    return out


def _lane_rows(exact: Tensor, p: int, q: int) -> Tensor:
    """The exact lane padded to ``P`` chunks of ``q`` floats, as ``P`` rows of bytes (chunk ``i`` for rank ``i``)."""
    lane = torch.zeros(p * q, dtype=torch.float32, device=exact.device)
    lane[: exact.numel()] = exact.reshape(-1)
    return lane.view(torch.uint8).view(p, SCALE_BYTES * q)


def _lane_mean(received: Tensor, p: int, q: int) -> Tensor:
    """My chunk of the lane from the ``P`` received rows (bytes): each copy divided by ``P``, summed in rank order."""
    return _sum_in_rank_order(received.contiguous().view(torch.float32).view(p, q).div_(p)).view(torch.uint8)


def _sum_in_rank_order(rows: Tensor, into_first: bool = False) -> Tensor:
    """The sum of ``rows`` (one per rank), added row by row in rank order: faster than ``sum(0)`` on CPU.

    ``into_first``: summed into ``rows[0]`` (no new row; the first row is overwritten).
    """
    total = rows[0] if into_first else rows[0].clone()
    for i in range(1, rows.shape[0]):
        total.add_(rows[i])
    return total


def _lane_back(exact: Tensor, gathered: Tensor) -> None:
    """Write the averaged lane, the servers' chunks as gathered (rows of bytes), into ``exact``."""
    exact.copy_(gathered.contiguous().view(torch.float32).reshape(-1)[: exact.numel()].view_as(exact))


#: on the CPU, branch on the host (reading a CPU tensor drains no queue); ``False`` in tests runs
#: the accelerator path on the CPU, which must give the same bits
_HOST_BRANCH_ON_CPU = True


def _scratch(like: Tensor) -> Tensor | None:
    """A buffer for :func:`_update_error` on an accelerator; ``None`` where the host branch needs none."""
    return None if _HOST_BRANCH_ON_CPU and like.device.type == "cpu" else torch.empty_like(like)


def _update_error(ok: Tensor, error: Tensor, compute: Callable[[Tensor], None], scratch: Tensor | None) -> None:
    """``compute(out)`` writes the new error into ``out``; keep it in ``error`` only where ``ok`` (0-dim bool).

    On an accelerator: computed into ``scratch`` (same size, not overlapping the inputs), then
    ``error <- where(ok, scratch, error)``, no host read. On the CPU, where the read is free, a
    host branch writes straight into ``error`` and saves that pass. Same bits either way.
    """
    if _HOST_BRANCH_ON_CPU and ok.device.type == "cpu":
        if bool(ok):
            compute(error)
        return
    assert scratch is not None, "the accelerator path needs a scratch buffer (see _scratch)"
    compute(scratch)
    torch.where(ok, scratch, error, out=error)


def _tile(bounds: tuple[int, ...], times: int) -> tuple[int, ...]:
    """Segment bounds of ``times`` copies of a vector laid end to end."""
    starts = np.asarray(bounds[:-1], dtype=np.int64) + bounds[-1] * np.arange(times, dtype=np.int64)[:, None]
    return (*starts.reshape(-1).tolist(), times * bounds[-1])
