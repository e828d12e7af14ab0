"""1-bit compression primitives: pure tensor operations, no communication.

The 1-bit operator of 1-bit Adam (Tang et al., 2021, https://arxiv.org/abs/2102.02888) maps a
vector ``x`` of ``n`` elements to

.. math::

    C[x] = s \\cdot \\operatorname{sign}(x), \\qquad s = \\frac{\\lVert x \\rVert_2}{\\sqrt{n}},

where ``sign`` reads the floating-point sign bit: ``sign(+0.0) = +1`` and ``sign(-0.0) = -1`` (one
bit has no zero), so ``C[x] = copysign(s, x)`` element by element and the compression error is
``x - C[x]``. Signs travel packed eight to a byte, most significant bit first, bit ``1`` for
``+1``; the scale travels as one float.

The compressed allreduce (:mod:`hf_zeroone.comm`) splits a flat vector into ``world_size`` equal
chunks, each a whole number of bytes once packed. :class:`ChunkLayout` describes that split for a
vector of ``n`` real elements. Within a chunk, the vector is cut into *segments* at caller-given
points (the boundaries of the parameter tensors packed into the vector), and each segment gets its
own scale: one tensor's small gradients are not blown up to the magnitude of its neighbour's.
That costs four bytes per segment, a few hundred bytes per call for a BERT model.

Segments are contiguous; runs of one length are matrix views, an operation per run (``_runs``).
Packing and unpacking go through NumPy's bit routines on the CPU (much faster there than torch's
bit arithmetic) and through torch's elsewhere, with the same bits.

The layout also carries a 0/1 *mask*, zero on the padding and on any element kept out of
compression (momentum that is always exactly zero). Masked elements take no part in a scale,
never build up error, and decompress to exactly zero (the caller zeroes them, see
:mod:`hf_zeroone.comm`). A layout whose only masked elements are the padding stores no mask:
:attr:`ChunkLayout.mask` builds one when asked, and callers zero the padding tail instead. The
float8 codec of exact steps is in :mod:`hf_zeroone.float8`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hf_zeroone._runs import Run, expanded, few, run_entries, run_rows, runs

__all__ = [
    "ChunkLayout",
    "compression_error",
    "decompress",
    "padded_length",
    "pack_signs",
    "scales_from_norms",
    "segment_scales",
    "unpack_signs",
]

_BITS_PER_BYTE = 8
# Multiplying a little-endian word of eight 0/1 bytes by this constant (the sum of 2 ** (63 - 9 j)
# for j = 0..7, written as a signed int64) lands byte j's bit at bit 63 - j of the product, with no
# two partial products on the same bit (so no carries): the top byte holds the eight bits, the
# first one highest.
_GATHER_BITS = 0x8040201008040201 - (1 << 64)
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def padded_length(numel: int, world_size: int) -> int:
    """Smallest length ``>= numel`` that splits into ``world_size`` chunks of whole bytes.

    Every chunk must pack into whole bytes, so the padded length is a multiple of
    ``8 * world_size``. ``padded_length(0, p) == 0``.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    quantum = _BITS_PER_BYTE * world_size
    return -(-numel // quantum) * quantum


def pack_signs(x: Tensor) -> Tensor:
    """Pack the signs of ``x`` into bytes: bit ``1`` where the sign bit is clear (``+1``), ``0`` for ``-1``.

    Eight signs per byte, first element in the most significant bit. ``x`` may have any shape
    whose last dimension is a multiple of 8; the result has the same leading dimensions and a last
    dimension eight times smaller, dtype ``uint8``.
    """
    if x.shape[-1] % _BITS_PER_BYTE:
        raise ValueError(
            f"pack_signs needs a last dimension that is a multiple of 8, got shape {tuple(x.shape)}; "
            "pad the input with padded_length() first"
        )
    x = x.detach()
    if x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES:
        packed = np.packbits(np.signbit(x.numpy()), axis=-1)
        np.invert(packed, out=packed)
        return torch.from_numpy(packed)
    return _pack_signs_torch(x)


def _pack_signs_torch(x: Tensor) -> Tensor:
    """:func:`pack_signs` in torch operations only (any device, any floating dtype)."""
    # the sign bit is clear exactly where the bits, read as a signed integer, are not negative
    positive = (x.view(_SAME_SIZE_INT[x.element_size()]) >= 0).contiguous()  # a last dim of stride 1
    words = positive.view(torch.uint8).reshape(-1, _BITS_PER_BYTE).view(torch.int64).reshape(-1)
    packed = (words * _GATHER_BITS) >> 56  # the cast to uint8 keeps the low byte: the eight bits
    return packed.to(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // _BITS_PER_BYTE)


#: per (dtype, device): the bit masks 128, 64, ..., 1 of a byte's eight signs, +1 and -1
_SELECT_OPERANDS: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}


@functools.cache
def _numpy_sign_table(dtype: torch.dtype) -> np.ndarray:
    """A (256, 8) NumPy table: row ``b`` holds the eight signs (+1/-1) that byte ``b`` encodes."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1)  # first element highest
    return bits.astype(_NUMPY_DTYPES[dtype]) * 2 - 1


def unpack_signs(packed: Tensor, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
    """Inverse of :func:`pack_signs`: bytes back to +1/-1 values of ``dtype``.

    The result has the leading dimensions of ``packed`` and a last dimension eight times larger:
    a new tensor, or ``out`` (contiguous, of ``dtype``, eight elements per byte; its shape is not
    checked, only its size) written in place. On the CPU, writing into memory already in use
    saves the page faults of a fresh allocation, which cost more than the unpacking itself.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_signs expects a uint8 tensor, got {packed.dtype}")
    shape = (*packed.shape[:-1], packed.shape[-1] * _BITS_PER_BYTE)
    if out is not None and (out.dtype != dtype or not out.is_contiguous() or out.numel() != 8 * packed.numel()):
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of {8 * packed.numel()} elements, got {out.dtype} "
            f"of shape {tuple(out.shape)}"
        )
    if packed.device.type != "cpu" or dtype not in _NUMPY_DTYPES:
        if out is None:
            return _unpack_signs_elementwise(packed, dtype).reshape(shape)
        _unpack_signs_elementwise(packed, dtype, out=out.view(-1, _BITS_PER_BYTE))
        return out
    signs_table, flat = _numpy_sign_table(dtype), packed.reshape(-1).numpy()
    rows = np.empty((flat.size, _BITS_PER_BYTE), signs_table.dtype) if out is None else out.numpy()
    signs = _take(signs_table, flat, rows.reshape(-1, _BITS_PER_BYTE))
    return torch.from_numpy(signs).reshape(shape) if out is None else out


_TAKE_BLOCK = 1 << 16  # indices per np.take call (see _take)


def _take(table: np.ndarray, index: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[i] = table[index[i]]`` for uint8 ``index`` (rows of ``table`` along its first axis); returns ``out``.

    In blocks: NumPy converts the indices to a new int64 array first, eight bytes per index, which
    for a whole vector of float8 codes is twice the vector's float32 size. ``mode="clip"``
    (every byte indexes the 256 rows) keeps NumPy from buffering ``out`` as well.
    """
    for start in range(0, index.size, _TAKE_BLOCK):
        stop = min(start + _TAKE_BLOCK, index.size)
        np.take(table, index[start:stop], axis=0, out=out[start:stop], mode="clip")
    return out


def _unpack_signs_elementwise(packed: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """:func:`unpack_signs` in three element-wise passes, for accelerators: ``(n, 8)`` signs of ``dtype`` (or ``out``).

    A gather of table rows (NumPy's form on the CPU) uses a small fraction of a GPU's memory
    bandwidth; a bit test per output element and a select between +1 and -1 stream instead, with
    the same values. The masks and the two signs are made on the device once (a copy from the host would
    wait for the device).
    """
    key = (dtype, packed.device)
    if key not in _SELECT_OPERANDS:
        masks = torch.full((8,), 128, dtype=torch.uint8, device=packed.device) >> torch.arange(
            8, dtype=torch.uint8, device=packed.device
        )
        plus = torch.ones((), dtype=dtype, device=packed.device)
        _SELECT_OPERANDS[key] = (masks, plus, -plus)
    masks, plus, minus = _SELECT_OPERANDS[key]
    positive = torch.bitwise_and(packed.reshape(-1, 1), masks).ne(0)
    if out is None:
        return torch.where(positive, plus, minus)
    return torch.where(positive, plus, minus, out=out)


def _segments(x: Tensor, bounds: Sequence[int]) -> list[Tensor]:
    """The segments of ``x`` as views, in one call (not a slice each)."""
    return list(x.split([b - a for a, b in zip(bounds[:-1], bounds[1:])]))


def _runs(bounds: Sequence[int]) -> list[Run] | None:
    """The segments' :func:`~hf_zeroone._runs.runs`, when handled a run at a time; ``None``: all at once.

    An operation per run is a kernel launch on a GPU, and a compressed allreduce applies scales
    four times: runs serve when they are :func:`~hf_zeroone._runs.few` (a model's tensors of one
    shape in every layer, 1-bit DiLoCo's blocks) or their segments long. Many short segments of
    varied lengths get their scales expanded element by element
    (:func:`~hf_zeroone._runs.expanded`, an extra pass over the vector) and their norms in one
    multi-tensor call. Both forms give the same bits.
    """
    by_run = runs(np.diff(np.asarray(bounds, dtype=np.int64)))  # cached per layout (_runs.runs)
    segments = sum(run[4] for run in by_run)
    return by_run if few(by_run) or bounds[-1] >= EXPAND_BELOW * segments else None


#: many segments of varied lengths shorter than this on average get their scales expanded (a little per
#: element) rather than a call each (a kernel launch on a GPU); ``recipes/bench_kernels.py`` times both
EXPAND_BELOW = 1 << 19


def _check_bounds(x: Tensor, scales_or_counts: Tensor, bounds: Sequence[int]) -> None:
    if len(bounds) != scales_or_counts.numel() + 1 or bounds[0] != 0 or bounds[-1] != x.numel():
        raise ValueError(
            f"bounds must run from 0 to {x.numel()} with one entry more than the {scales_or_counts.numel()} "
            f"segments, got {len(bounds)} entries from {bounds[0] if bounds else None} to "
            f"{bounds[-1] if bounds else None}"
        )


def segment_scales(x: Tensor, bounds: Sequence[int], counts: Tensor) -> Tensor:
    """Scale of each segment, ``||x_seg||_2 / sqrt(count_seg)``, zero for a segment with no element.

    ``x`` is flat with masked entries already zero; segment ``j`` is ``x[bounds[j]:bounds[j+1]]``
    (an empty segment is allowed); ``counts`` (float) holds the number of unmasked elements of
    each segment.
    """
    _check_bounds(x, counts, bounds)
    by_run = _runs(bounds)
    if by_run is None:
        return scales_from_norms(torch.stack(torch._foreach_norm(_segments(x, bounds))), counts)
    norms = x.new_zeros(counts.numel())  # an empty segment's norm is 0
    for run in by_run:
        run_entries(norms, run).copy_(torch.linalg.vector_norm(run_rows(x, run), dim=1))
    return scales_from_norms(norms, counts)


def scales_from_norms(norms: Tensor, counts: Tensor) -> Tensor:
    """:func:`segment_scales` from the segments' 2-norms (float32, as ``torch._foreach_norm`` gives them)."""
    return torch.where(counts > 0, norms / counts.clamp(min=1).sqrt(), 0.0)


def compression_error(x: Tensor, scales: Tensor, bounds: Sequence[int], out: Tensor) -> Tensor:
    """``out = x - C[x]`` with ``C[x] = copysign(scale_seg, x)`` on each segment; returns ``out``.

    ``out`` must not overlap ``x``. The signs are the ones :func:`pack_signs` sends.
    """
    _check_bounds(x, scales, bounds)
    by_run = _runs(bounds)
    if by_run is None:
        torch.copysign(expanded(scales, bounds), x, out=out)
        return torch.sub(x, out, out=out)
    for run in by_run:
        torch.copysign(run_entries(scales, run)[:, None], run_rows(x, run), out=run_rows(out, run))
    return torch.sub(x, out, out=out)


def decompress(packed: Tensor, scales: Tensor, bounds: Sequence[int], out: Tensor | None = None) -> Tensor:
    """``C[x]`` from its packed signs and segment scales: a new flat float32 tensor, or ``out`` (flat, float32)."""
    out = unpack_signs(packed, out=out).reshape(-1)
    _check_bounds(out, scales, bounds)
    by_run = _runs(bounds)
    if by_run is None:
        return out.mul_(expanded(scales, bounds))
    for run in by_run:
        run_rows(out, run).mul_(run_entries(scales, run)[:, None])
    return out


@dataclass(frozen=True)
class ChunkLayout:
    """How a flat vector of ``numel`` real elements is padded, chunked and cut into segments.

    Attributes:
        numel: number of real elements.
        world_size: number of chunks (one per rank).
        chunk: elements per chunk, a multiple of 8 (``0`` for an empty vector).
        segments_per_chunk: ``S``: every chunk is cut into exactly ``S`` segments, the last ones
            possibly empty; segment ``j`` of chunk ``k`` has index ``k * S + j``.
        bounds: ``world_size * S + 1`` nondecreasing offsets into the padded vector: segment
            ``i`` is ``[bounds[i], bounds[i + 1])``, and ``bounds[k * S] == k * chunk``.
        segment_counts: float, ``world_size * S`` long: unmasked elements per segment.
        stored_mask: the uint8 mask (see :attr:`mask`) when caller-masked elements exist,
            ``None`` when only the padding is masked (nothing stored).
        fully_unmasked: ``True`` when only padding is masked.
    """

    numel: int
    world_size: int
    chunk: int
    segments_per_chunk: int
    bounds: tuple[int, ...]
    segment_counts: Tensor
    stored_mask: Tensor | None
    fully_unmasked: bool

    @property
    def mask(self) -> Tensor:
        """uint8, ``padded`` long: 1 where an element takes part in compression, 0 on padding and
        on caller-masked elements. Built anew on each access when the layout is fully unmasked."""
        if self.stored_mask is not None:
            return self.stored_mask
        mask = torch.zeros(self.padded, dtype=torch.uint8, device=self.segment_counts.device)
        mask[: self.numel] = 1
        return mask

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors this layout holds (``segment_counts``, and the mask when stored)."""
        return (self.segment_counts,) if self.stored_mask is None else (self.segment_counts, self.stored_mask)

    @property
    def padded(self) -> int:
        return self.world_size * self.chunk

    @property
    def chunk_bytes(self) -> int:
        return self.chunk // _BITS_PER_BYTE

    def chunk_bounds(self, k: int) -> tuple[int, ...]:
        """Segment bounds of chunk ``k``, relative to the chunk start (``S + 1`` offsets, ``0 .. chunk``)."""
        s = self.segments_per_chunk
        return tuple((np.asarray(self.bounds[k * s : (k + 1) * s + 1], dtype=np.int64) - k * self.chunk).tolist())

    def chunk_segment_counts(self, k: int) -> Tensor:
        s = self.segments_per_chunk
        return self.segment_counts[k * s : (k + 1) * s]

    @classmethod
    def from_mask(
        cls,
        numel: int,
        world_size: int,
        element_mask: Tensor | None = None,
        device: torch.device | str = "cpu",
        segment_starts: Sequence[int] = (),
    ) -> ChunkLayout:
        """Build a layout.

        Args:
            numel: real elements.
            world_size: ranks (chunks).
            element_mask: bool or 0/1, ``numel`` long; zero keeps an element out of compression.
            device: where the layout's tensors live.
            segment_starts: offsets where a new segment begins (e.g. where each packed tensor
                starts); chunk starts are always segment starts.
        """
        padded = padded_length(numel, world_size)
        chunk = padded // world_size
        mask = None
        if element_mask is not None:
            flat = element_mask.reshape(-1)
            if flat.numel() != numel:
                raise ValueError(f"element_mask has {flat.numel()} elements, expected {numel}")
            if not bool((flat != 0).all()):
                mask = torch.zeros(padded, dtype=torch.uint8, device=device)
                mask[:numel] = (flat != 0).to(device=device, dtype=torch.uint8)
        if padded == 0:
            bounds = (0,) * (world_size + 1)
            return cls(numel, world_size, 0, 1, bounds, torch.zeros(world_size, device=device), None, True)
        cuts = {int(o) for o in segment_starts if 0 < o < numel}
        per_chunk = [sorted({o for o in cuts if o // chunk == k} | {k * chunk}) for k in range(world_size)]
        s_max = max(len(starts) for starts in per_chunk)
        bounds: list[int] = []
        for k, starts in enumerate(per_chunk):
            bounds += starts + [(k + 1) * chunk] * (s_max - len(starts))
        bounds.append(padded)
        # unmasked elements per segment, counted exactly (then rounded once to float32)
        pairs = list(zip(bounds[:-1], bounds[1:]))
        if mask is None:
            counts = torch.tensor([max(0, min(b, numel) - a) for a, b in pairs], dtype=torch.float64)
        else:
            counts = torch.stack([mask[a:b].sum(dtype=torch.float64) for a, b in pairs])
        counts = counts.to(device=device, dtype=torch.float32)
        return cls(numel, world_size, chunk, s_max, tuple(bounds), counts, mask, mask is None)
