"""Runs of same-sized pieces in a flat vector: the views and per-piece operands that cost a call per run, not per piece.

A flat message, a DDP bucket or an optimizer's flat state holds many tensors end to end; a
compressed message holds many segments. Pieces of one size at evenly spaced offsets (one layer's
tensor in every layer, whatever lies between) are one strided view, so an operation with a
per-piece operand, or a reduction per piece, is a call per run.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor


def pieces(vector: Tensor, like: list[Tensor], reverse: bool) -> list[Tensor]:
    """``vector`` cut into pieces shaped like ``like``'s tensors, laid in it in order or (``reverse``) reversed.

    Tensors of one shape at evenly spaced offsets (a layer's weight in every layer, whatever lies
    between) are one strided view, unbound: a few calls per shape, not one or two per tensor.
    """
    order = like[::-1] if reverse else like
    numels = [t.numel() for t in order]
    offsets = (np.cumsum(numels) - numels).tolist()
    out: list[Tensor] = [None] * len(order)  # type: ignore[list-item]
    by_shape: dict[torch.Size, list[int]] = {}
    for i, t in enumerate(order):
        by_shape.setdefault(t.shape, []).append(i)
    for shape, index in by_shape.items():
        inner = [math.prod(shape[k + 1 :]) for k in range(len(shape))]  # row-major strides
        for run, step in _evenly_spaced(index, [offsets[i] for i in index], False):
            block = vector.as_strided((len(run), *shape), (step, *inner), vector.storage_offset() + offsets[run[0]])
            for i, piece in zip(run, block.unbind(0)):
                out[i] = piece
    return out[::-1] if reverse else out


def _evenly_spaced(index: list[int], offsets: list[int], even_index: bool) -> list[tuple[list[int], int]]:
    """``index`` cut into its longest runs, from the first, whose ``offsets`` are evenly spaced (and, with
    ``even_index``, the indices too); each run with its offset step (1 for a lone one)."""
    out, j = [], 0
    while j < len(index):
        k = j + 1
        if k < len(index):
            di, do = index[k] - index[j], offsets[k] - offsets[j]
            while k < len(index) and offsets[k] - offsets[k - 1] == do:
                if even_index and index[k] - index[k - 1] != di:
                    break
                k += 1
        out.append((index[j:k], offsets[j + 1] - offsets[j] if k > j + 1 else 1))
        j = k
    return out


#: pieces of one length go a run at a time when the runs hold at least this many pieces on average
PIECES_PER_RUN = 4

Run = tuple[int, int, int, int, int, int]


def runs(lengths: Sequence[int]) -> list[Run]:
    return _runs_of(tuple(int(n) for n in lengths))


@functools.lru_cache(maxsize=256)  # a pure function of a layout: the same at every step
def _runs_of(lengths: tuple[int, ...]) -> list[Run]:
    """``(first piece, piece step, offset, offset step, pieces, length)`` of each run of non-empty pieces
    of one length at evenly spaced positions and offsets.

    The pieces tile a vector in order (a message's tensors, a compressed one's segments): runs of
    consecutive ones, and a layer's tensor of one shape in every layer with others between. A run
    is one strided ``(pieces, length)`` view (:func:`run_rows`) and its per-piece values one strided
    vector (:func:`run_entries`): an operand or a reduction per piece (a row is reduced with the
    piece's own bits) is one call per run, worth it when the runs are :func:`few`.
    """
    offsets = (np.cumsum(lengths) - lengths).tolist()
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            by_length.setdefault(n, []).append(i)
    out = []
    for n, index in by_length.items():
        for run, step in _evenly_spaced(index, [offsets[i] for i in index], True):
            out.append((run[0], run[1] - run[0] if len(run) > 1 else 1, offsets[run[0]], step, len(run), n))
    return out


def run_rows(t: Tensor, run: Run) -> Tensor:
    """The pieces of a run of :func:`runs` in flat ``t``, one row each."""
    _, _, o, do, m, n = run
    return t.as_strided((m, n), (do, 1), t.storage_offset() + o)


def run_entries(v: Tensor, run: Run) -> Tensor:
    """The entries of per-piece vector ``v`` that belong to a run of :func:`runs`, as a strided vector."""
    j, dj, _, _, m, _ = run
    return v.as_strided((m,), (dj,), v.storage_offset() + j)


def few(pieces_by_run: Sequence[Run]) -> bool:
    """Whether :func:`runs` hold at least :data:`PIECES_PER_RUN` pieces each on average (a call per run pays)."""
    return PIECES_PER_RUN * len(pieces_by_run) <= sum(run[4] for run in pieces_by_run)


#: per (bounds, device): the segment starts inside the vector and as many ones, on the device (see expanded);
#: kept for the process's life (one entry per layout: a bucket's, a list of tensors'): CUDA graphs read them
SEGMENT_STARTS: dict[tuple[tuple[int, ...], torch.device], tuple[Tensor, Tensor]] = {}


def expanded(scales: Tensor, bounds: Sequence[int]) -> Tensor:
    """``scales[j]`` at every element of segment ``j``: a flat tensor of ``bounds[-1]`` elements.

    A 1 at each segment start (an empty segment's adds to the next one's), a running sum (each
    element's segment index) and a gather, whatever the number of segments; the starts reach the
    device once per layout, through pinned memory. Faster than ``repeat_interleave`` on the CPU.
    """
    key = (tuple(bounds), scales.device)
    dtype = torch.int32 if bounds[-1] < 2**31 else torch.int64
    cached = SEGMENT_STARTS.get(key)
    if cached is None:
        host = torch.tensor([b for b in bounds[1:-1] if b < bounds[-1]], dtype=torch.int64)
        if scales.device.type == "cuda":
            host = host.pin_memory()
        starts = host.to(scales.device, non_blocking=True)
        cached = SEGMENT_STARTS[key] = (starts, torch.ones(starts.numel(), dtype=dtype, device=scales.device))
    starts, ones = cached
    index = torch.zeros(bounds[-1], dtype=dtype, device=scales.device)
    index.index_add_(0, starts, ones)
    return scales.index_select(0, index.cumsum_(0))


def apply_to_pieces(op: str, target: Tensor, numels: Sequence[int], vector: Tensor) -> None:
    """``piece <op>= vector[i]`` (``op``: ``"mul"`` or ``"div"``) for each piece ``i`` of flat ``target``, which
    pieces of ``numels`` tile in order: a call per run where they are :func:`few`, else the entries expanded."""
    if few(by_run := runs(numels)):
        for run in by_run:
            getattr(run_rows(target, run), f"{op}_")(run_entries(vector, run)[:, None])
    else:
        getattr(target, f"{op}_")(expanded(vector, np.cumsum([0, *numels]).tolist()))


def per_piece(
    fn: Callable[..., Tensor], span: Tensor, like: Sequence[Tensor], reverse: bool = False, *operands: Tensor
) -> Tensor | None:
    """``fn(rows, *entries)`` (a value per row) for each run of the pieces shaped like ``like`` that tile flat
    ``span`` in order or (``reverse``) reversed, with each per-piece operand's entries for the run: one vector of a
    value per piece, in ``like``'s order (0 for an empty one); ``None`` where the runs are not :func:`few`."""
    laid, operands = (like[::-1], [o.flip(0) for o in operands]) if reverse else (like, list(operands))
    by_run = runs([t.numel() for t in laid])
    if not few(by_run):
        return None
    values = [(run, fn(run_rows(span, run), *(run_entries(o, run) for o in operands))) for run in by_run]
    out = torch.zeros(len(like), dtype=values[0][1].dtype if values else span.dtype, device=span.device)
    for run, value in values:
        run_entries(out, run).copy_(value)
    return out.flip(0) if reverse else out
