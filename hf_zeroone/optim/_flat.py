"""Flat error-feedback buffers over an ordered list of parameters, with per-parameter views as state.

The compressed allreduce (:meth:`hf_zeroone.comm.Communicator.compressed_allreduce_async`) works on
flat vectors: a worker error of ``layout.padded`` elements and a server error of ``layout.chunk``
elements (this rank's chunk only). The optimizer's state stays per parameter, so checkpoints do not
depend on DDP's buckets: the state entries are views into the flat storage,

* ``"worker_error"``: shaped like the parameter, every element;
* ``"server_error"``: one-dimensional, only the parameter's elements that fall into this rank's
  chunk (possibly none), and ``"server_error_start"``: the index (into the flattened parameter) of
  its first element.

A parameter's elements lie in the flat vectors in the order DDP lays its gradient in a bucket:
its memory order when that is dense (a transposed weight, a ``channels_last`` convolution),
row-major otherwise (:func:`layout_view`); "the flattened parameter" above
means this order.

When a new layout is built for parameters that already have error state (DDP rebuilt its buckets,
0/1 Adam's syncs use other groups than its 1-bit gradients, a mask changed, a checkpoint was
loaded), the values move into the new storage: all of the worker error, and of the server error
the elements this rank serves in both layouts. A server error of an element that moves to another
rank's chunk is dropped (the new server starts it from zero); the rank that held it could not have
passed it on without communicating. A cached layout that shares a parameter with the new one no
longer backs any state and is freed.

Messages are not stored: each call gets a new buffer (:meth:`FlatBuffers.new_message`); the
compressed allreduce returns its result in that buffer's memory, freed once the result is used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hf_zeroone._runs import pieces as run_views
from hf_zeroone.compression import ChunkLayout

__all__ = [
    "ERROR_STATE",
    "FlatBufferCache",
    "FlatBuffers",
    "build_flat_buffers",
    "consecutive_views",
    "place_server_error",
    "refresh_layout",
    "restore_errors",
    "split_in_buckets",
]

#: a parameter's error-feedback state entries: its two buffers and where its server error starts
ERROR_STATE = ("worker_error", "server_error", "server_error_start")


def _dense_in_its_own_order(t: Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory without gaps or overlaps (its strides a permutation).

    The rule of ``TensorImpl::compute_non_overlapping_and_dense``, by which DDP lays a parameter's
    gradient in its bucket: dimensions of size 1 do not count.
    """
    dims = sorted((d for d in range(t.dim()) if t.size(d) > 1), key=t.stride)
    expected = 1
    for d in dims:
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def _laid_out_row_major(like: Tensor) -> bool:
    """Whether DDP lays ``like``'s gradient row-major in a bucket: contiguous, or not dense in its own order."""
    return like.is_contiguous() or not _dense_in_its_own_order(like)


def layout_view(flat: Tensor, offset: int, like: Tensor) -> Tensor:
    """``flat[offset : offset + like.numel()]`` seen with ``like``'s shape, in the order DDP lays ``like`` in a bucket.

    DDP keeps a gradient in its bucket in its parameter's memory order when that order is dense (a
    transposed weight, a ``channels_last`` convolution), row-major otherwise, and reads the hook's
    result back the same way (``GradBucket.gradients()`` views every one row-major all the same,
    torch 2.13). ``step()`` uses the same order, so both paths send the same bytes.
    """
    piece = flat[offset : offset + like.numel()]
    if _laid_out_row_major(like):
        return piece.view(like.shape)
    return piece.as_strided(like.shape, like.stride())


def layout_views(flat: Tensor, offsets: Sequence[int], likes: Sequence[Tensor]) -> list[Tensor]:
    """:func:`layout_view` of ``flat`` at each offset for each tensor of ``likes``, from one split of ``flat``.

    Only tensors that are not one-dimensional take a second call (their shape). Offsets must not
    decrease, and the pieces must not overlap.
    """
    if not likes:
        return []
    if offsets[0] == 0 and all(map(_laid_out_row_major, likes)) and _consecutive(offsets, likes):
        return run_views(flat, list(likes), False)  # one view per run of same-shaped tensors, unbound
    sizes, picks, pos = [], [], 0
    for offset, like in zip(offsets, likes):
        if offset < pos:
            raise ValueError(f"layout_views: offset {offset} inside the previous piece (which ends at {pos})")
        if offset > pos:
            sizes.append(offset - pos)
        picks.append(len(sizes))
        sizes.append(like.numel())
        pos = offset + like.numel()
    if pos < flat.numel():
        sizes.append(flat.numel() - pos)
    pieces = flat.split(sizes)
    out = []
    for i, like in zip(picks, likes):
        piece = pieces[i]
        if not _laid_out_row_major(like):
            out.append(piece.as_strided(like.shape, like.stride()))
        else:
            out.append(piece if piece.shape == like.shape else piece.view(like.shape))
    return out


def _consecutive(offsets: Sequence[int], likes: Sequence[Tensor]) -> bool:
    """Whether each piece starts where the one before ends."""
    return all(a + t.numel() == b for a, t, b in zip(offsets, likes, offsets[1:]))


def layout_order(t: Tensor, like: Tensor) -> Tensor:
    """``t``, shaped like ``like``, flat in ``like``'s :func:`layout_view` order (``reshape(-1)`` if contiguous)."""
    if _laid_out_row_major(like):
        return t.reshape(-1)
    out = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    layout_view(out, 0, like).copy_(t)
    return out


@dataclass
class FlatBuffers:
    """Flat fp32 error buffers for one ordered list of parameters (all of them, or one DDP bucket).

    ``worker_error`` (``layout.padded`` elements) and ``server_error`` (``layout.chunk`` elements:
    this rank's chunk) are the storage behind the per-parameter state entries of the same names.
    """

    params: tuple[Tensor, ...]
    offsets: tuple[int, ...]
    layout: ChunkLayout
    worker_error: Tensor
    server_error: Tensor
    worker_error_views: tuple[Tensor, ...]

    def new_message(self) -> Tensor:
        """A new, uninitialised fp32 buffer of ``layout.padded`` elements for one call's message."""
        return torch.empty(self.layout.padded, dtype=torch.float32, device=self.worker_error.device)

    @property
    def message(self) -> Tensor:
        """Same as :meth:`new_message`: a *new* buffer on every access (messages are not kept)."""
        return self.new_message()

    def views(self, flat: Tensor) -> list[Tensor]:
        """Slices of ``flat`` shaped like each parameter, in DDP's order (:func:`layout_view`)."""
        return layout_views(flat, self.offsets, self.params)


def consecutive_views(params: Sequence[Tensor], flat: Tensor) -> list[Tensor]:
    """Consecutive slices of ``flat`` shaped like each of ``params``, each in DDP's order (:func:`layout_view`)."""
    offsets, offset = [], 0
    for p in params:
        offsets.append(offset)
        offset += p.numel()
    return layout_views(flat, offsets, params)


def split_in_buckets(items: Sequence[tuple[Any, Tensor]], cap: int) -> list[list[tuple[Any, Tensor]]]:
    """``(group, param)`` pairs cut, in order, into buckets of at most ``cap`` elements.

    A parameter larger than ``cap`` gets a bucket of its own.
    """
    buckets: list[list[tuple[Any, Tensor]]] = []
    size = 0
    for item in items:
        n = item[1].numel()
        if not buckets or (buckets[-1] and size + n > cap):
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += n
    return buckets


def _overlap(offset: int, numel: int, lo: int, hi: int) -> tuple[int, int]:
    """Elements ``[a, b)`` of a parameter at ``offset`` whose layout positions lie in ``[lo, hi)``."""
    a = min(max(lo - offset, 0), numel)
    return a, max(min(hi - offset, numel), a)


def place_server_error(state: dict[str, Any], view: Tensor, start: int) -> None:
    """Make ``view`` (elements ``start ..`` of the flattened parameter) the state's server error.

    ``view`` holds zeros; the elements the previous entry (a view of an older layout, or a loaded
    tensor) and the new one have in common are copied into it.
    """
    old = state.get("server_error")
    if old is not None:
        old = old.reshape(-1)
        s = int(state.get("server_error_start", 0))
        lo, hi = max(start, s), min(start + view.numel(), s + old.numel())
        if hi > lo:
            view[lo - start : hi - start].copy_(old[lo - s : hi - s])
    state["server_error"] = view
    state["server_error_start"] = start


def _layout(
    params: Sequence[Tensor], offsets: Sequence[int], state_of: Callable[[Tensor], dict[str, Any]], world_size: int
) -> ChunkLayout:
    """The layout of ``params`` at ``offsets``, masked where their ``momentum_mask`` is zero."""
    device = params[0].device
    masks = [state_of(p).get("momentum_mask") for p in params]
    element_mask = None
    if any(m is not None for m in masks):
        ones = functools.partial(torch.ones, dtype=torch.bool, device=device)
        element_mask = torch.cat(
            [layout_order(m.to(device) != 0, p) if m is not None else ones(p.numel()) for m, p in zip(masks, params)]
        )
    total = offsets[-1] + params[-1].numel()
    return ChunkLayout.from_mask(total, world_size, element_mask, device, segment_starts=offsets)


def refresh_layout(entry: FlatBuffers, state_of: Callable[[Tensor], dict[str, Any]]) -> None:
    """Rebuild ``entry``'s layout after its parameters' masks changed (rows left a mask).

    Positions and chunks do not depend on the mask, so the error buffers stay where they are
    (their masked elements hold zeros, as a newly unmasked element's error starts).
    """
    entry.layout = _layout(entry.params, entry.offsets, state_of, entry.layout.world_size)


def build_flat_buffers(
    params: Sequence[Tensor],
    state_of: Callable[[Tensor], dict[str, Any]],
    world_size: int,
    rank: int,
    owner: str = "optimizer",
) -> FlatBuffers:
    """New flat buffers for ``params`` in this order; moves their error state into them (see above)."""
    device = params[0].device
    offsets, total = [], 0
    for p in params:
        if p.device != device:
            raise ValueError(
                f"{owner} needs all parameters communicated together on one device; found {p.device} and {device}"
            )
        offsets.append(total)
        total += p.numel()
    layout = _layout(params, offsets, state_of, world_size)
    worker = torch.zeros(layout.padded, dtype=torch.float32, device=device)
    lo, hi = rank * layout.chunk, (rank + 1) * layout.chunk
    server = torch.zeros(layout.chunk, dtype=torch.float32, device=device)
    for p, o in zip(params, offsets):
        state = state_of(p)
        view = layout_view(worker, o, p)
        if "worker_error" in state:
            view.copy_(state["worker_error"])
        state["worker_error"] = view
        a, b = _overlap(o, p.numel(), lo, hi)
        place_server_error(state, server[o + a - lo : o + b - lo] if b > a else server[:0], a)
    return FlatBuffers(
        params=tuple(params),
        offsets=tuple(offsets),
        layout=layout,
        worker_error=worker,
        server_error=server,
        worker_error_views=tuple(state_of(p)["worker_error"] for p in params),
    )


def restore_errors(state: dict[str, Any], p: Tensor, saved: dict[str, Any]) -> None:
    """Put the error-feedback entries of a checkpoint into ``state`` (of ``p``), in float32.

    ``saved`` holds the checkpoint's :data:`ERROR_STATE` entries of ``p`` (possibly none). A
    ``server_error`` without ``server_error_start`` (an older checkpoint's: the full-size buffer
    shaped like the parameter) starts at element 0. The next compressed step keeps the elements
    this rank serves in its layout then (:func:`place_server_error`).
    """
    for name in ERROR_STATE:
        state.pop(name, None)
    if "worker_error" in saved:
        value = saved["worker_error"]
        if value.numel() != p.numel():
            raise ValueError(
                f"the checkpoint's worker_error for a parameter of shape {tuple(p.shape)} has "
                f"{value.numel()} elements; it was saved for another model"
            )
        state["worker_error"] = value.to(device=p.device, dtype=torch.float32, copy=True).reshape(p.shape)
    if "server_error" in saved:
        value, start = saved["server_error"], int(saved.get("server_error_start", 0))
        if start < 0 or start + value.numel() > p.numel():
            raise ValueError(
                f"the checkpoint's server_error for a parameter of shape {tuple(p.shape)} covers elements "
                f"{start} to {start + value.numel()}; it was saved for another model"
            )
        state["server_error"] = value.to(device=p.device, dtype=torch.float32, copy=True).reshape(-1)
        state["server_error_start"] = start


class FlatBufferCache:
    """The optimizer's flat error buffers, one :class:`FlatBuffers` per ordered list of parameters.

    DDP's buckets, ``step()``'s own buckets and 0/1 Adam's syncs each ask for the parameters they
    communicate together; the first request for an order builds its buffers (moving each
    parameter's error state into them) and frees the cached buffers of any other order that shares
    a parameter with it (their storage no longer backs any state).
    """

    def __init__(self, state_of: Callable[[Tensor], dict[str, Any]], world_size: int, rank: int, owner: str) -> None:
        self._state_of, self._world, self._rank, self._owner = state_of, world_size, rank, owner
        self.entries: dict[tuple[int, ...], FlatBuffers] = {}

    def get(self, params: Sequence[Tensor]) -> FlatBuffers:
        """Flat buffers for ``params`` in this order (built on first use, see the class docstring)."""
        key = tuple(id(p) for p in params)
        entry = self.entries.get(key)
        if entry is not None and all(
            self._state_of(p).get("worker_error") is view for p, view in zip(entry.params, entry.worker_error_views)
        ):
            return entry
        ids = set(key)
        for other in [k for k in self.entries if ids.intersection(k)]:
            del self.entries[other]
        entry = build_flat_buffers(params, self._state_of, self._world, self._rank, self._owner)
        self.entries[key] = entry
        return entry

    def clear(self) -> None:
        self.entries.clear()

    def refresh_masks(self, changed: set[int]) -> None:
        """New layouts for the cached buffers holding a parameter (by ``id``) whose mask changed."""
        for entry in self.entries.values():  # same positions, new masks: the buffers stay
            if changed.intersection(map(id, entry.params)):
                refresh_layout(entry, self._state_of)
