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
call and keep each tensor's own magnitude (with one scale per chunk, 0/1 Adam diverged on a small
MLP whose layers have very different gradient scales; with per-segment scales it tracks AdamW).

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
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hf_zeroone.compression import ChunkLayout, compression_error, decompress, pack_signs, segment_scales

__all__ = ["SCALE_BYTES", "compressed_allreduce", "lane_floats"]

SCALE_BYTES = 4  # one float32


def lane_floats(length: int, world_size: int) -> int:
    """Floats of an exact lane of ``length`` that each chunk carries (the lane padded to ``P`` chunks)."""
    return -(-length // world_size)


def _zero_masked(t: Tensor, layout: ChunkLayout, start: int = 0, unless: Tensor | None = None) -> None:
    """Zero the masked elements of flat ``t``, which holds layout positions ``start ..``.

    Without caller masks only the padding at the end is masked: zero that tail instead of
    multiplying the whole vector by the mask (one pass over the data saved, five times a call).
    ``unless``: a 0-dim bool tensor; where it is true the tail is left as it is (a NaN result
    stays NaN everywhere). Multiplying by the mask keeps a NaN anyway.
    """
    if layout.fully_unmasked:
        first_pad = layout.numel - start
        if first_pad < t.numel():
            tail = t[max(first_pad, 0) :]
            if unless is None:
                tail.zero_()
            else:
                tail.masked_fill_(~unless, 0.0)
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
    y.add_(worker_error)
    _zero_masked(y, layout)
    scales = segment_scales(y, layout.bounds, layout.segment_counts)
    scales.masked_fill_(~torch.isfinite(scales).all(), math.nan)  # every server will see it
    send = torch.empty(p, row, dtype=torch.uint8, device=device)
    send[:, :nb] = pack_signs(y.view(p, c))
    send[:, nb : nb + sb] = scales.view(torch.uint8).view(p, sb)
    if q:
        lane = torch.zeros(p * q, dtype=torch.float32, device=device)
        lane[: exact.numel()] = exact.reshape(-1)
        send[:, nb + sb :] = lane.view(torch.uint8).view(p, lb)
    recv = torch.empty_like(send)
    coll.all_to_all(recv, send)
    # worker_scales[i, j]: scale of segment j of my chunk, as worker i compressed it
    worker_scales = recv[:, nb : nb + sb].contiguous().view(torch.float32).view(p, s_per)
    ok = torch.isfinite(worker_scales).all()  # 0-dim, on the device; the same on every rank

    # Stage 1, server side: average the P compressed copies of my chunk, compress again.
    bounds = layout.chunk_bounds(k)
    # the P copies side by side, each scaled by 1/P, then summed: z = mean_i C[y_ik] + e_s
    copies = decompress(recv[:, :nb], worker_scales.reshape(-1) / p, _tile(bounds, p)).view(p, c)
    z = torch.add(copies[0], server_error)
    for i in range(1, p):  # row by row: much faster than a sum over dim 0 on CPU
        z.add_(copies[i])
    _zero_masked(z, layout, start=k * c)
    s = segment_scales(z, bounds, layout.chunk_segment_counts(k))
    s.masked_fill_(~ok, math.nan)
    out_row = torch.empty(row, dtype=torch.uint8, device=device)
    out_row[:nb] = pack_signs(z).masked_fill_(~ok, 0)
    out_row[nb : nb + sb] = s.view(torch.uint8)
    if q:  # my chunk of the exact lane: each copy divided by P, then summed in rank order
        lanes = recv[:, nb + sb :].contiguous().view(torch.float32).view(p, q).div_(p)
        mean = lanes[0].clone()
        for i in range(1, p):
            mean.add_(lanes[i])
        out_row[nb + sb :] = mean.view(torch.uint8)

    # e_s <- z - C[z] and e_w <- y - C[y], only if every worker was finite (a NaN never enters an error)
    def server_side(out: Tensor) -> None:
        _zero_masked(compression_error(z, s, bounds, out=out), layout, start=k * c)

    def worker_side(out: Tensor) -> None:
        _zero_masked(compression_error(y, scales, layout.bounds, out=out), layout)

    _update_error(ok, server_error, server_side, torch.empty_like(z))
    _update_error(ok, worker_error, worker_side, copies.view(-1))  # the copies' memory is free now

    # Stage 2: every rank gets every server's chunk and decompresses the same bytes.
    gathered = torch.empty(p, row, dtype=torch.uint8, device=device)
    coll.all_gather(list(gathered.unbind(0)), out_row)
    server_scales = gathered[:, nb : nb + sb].contiguous().view(torch.float32).view(-1)
    if q:
        exact.copy_(gathered[:, nb + sb :].contiguous().view(torch.float32).reshape(-1)[: exact.numel()].view_as(exact))
    result = decompress(gathered[:, :nb], server_scales, layout.bounds)
    _zero_masked(result, layout, unless=~ok)  # a bad step's result stays NaN everywhere
    return result


#: on the CPU, branch on the host (reading a CPU tensor drains no queue); ``False`` in tests runs
#: the accelerator path on the CPU, which must give the same bits
_HOST_BRANCH_ON_CPU = True


def _update_error(ok: Tensor, error: Tensor, compute: Callable[[Tensor], None], scratch: Tensor) -> None:
    """``compute(out)`` writes the new error into ``out``; keep it in ``error`` only where ``ok`` (0-dim bool).

    On an accelerator: computed into ``scratch`` (same size, not overlapping the inputs), then
    ``error <- where(ok, scratch, error)``, no host read. On the CPU, where the read is free, a
    host branch writes straight into ``error`` and saves that pass. Same bits either way.
    """
    if _HOST_BRANCH_ON_CPU and ok.device.type == "cpu":
        if bool(ok):
            compute(error)
        return
    compute(scratch)
    torch.where(ok, scratch, error, out=error)


def _tile(bounds: tuple[int, ...], times: int) -> tuple[int, ...]:
    """Segment bounds of ``times`` copies of a vector laid end to end."""
    length = bounds[-1]
    return tuple(i * length + b for i in range(times) for b in bounds[:-1]) + (times * length,)
