"""1-bit compression primitives: pure tensor operations, no communication.

The 1-bit operator of 1-bit Adam (Tang et al., 2021, https://arxiv.org/abs/2102.02888) maps a
vector ``x`` of ``n`` elements to

.. math::

    C[x] = s \\cdot \\operatorname{sign}(x), \\qquad s = \\frac{\\lVert x \\rVert_2}{\\sqrt{n}},

with ``sign(0) = +1`` (one bit has no zero). Signs travel packed eight to a byte, most significant
bit first; the scale travels as one float.

The compressed allreduce (:mod:`hf_zeroone.comm`) splits a flat vector into ``world_size`` equal
chunks, each a whole number of bytes once packed. :class:`ChunkLayout` describes that split for a
vector of ``n`` real elements. Within a chunk, the vector is cut into *segments* at caller-given
points (the boundaries of the parameter tensors packed into the vector), and each segment gets its
own scale: one tensor's small gradients are not blown up to the magnitude of its neighbour's.
That costs four bytes per segment, a few hundred bytes per call for a BERT model.

The layout also carries a 0/1 *mask* that is zero on the padding and on any element the caller
wants kept out of compression (for example momentum that is always exactly zero). Masked
elements take no part in a scale, never build up error, and decompress to exactly zero.

Everything here is vectorised torch code and runs on any device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ChunkLayout",
    "padded_length",
    "pack_signs",
    "unpack_signs",
    "segment_scales",
]

_BITS_PER_BYTE = 8


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
    """Pack ``x >= 0`` into bytes, eight signs per byte, first element in the most significant bit.

    ``x`` may have any shape whose last dimension is a multiple of 8; the result has the same
    leading dimensions and a last dimension eight times smaller, dtype ``uint8``.
    """
    if x.shape[-1] % _BITS_PER_BYTE:
        raise ValueError(
            f"pack_signs needs a last dimension that is a multiple of 8, got shape {tuple(x.shape)}; "
            "pad the input with padded_length() first"
        )
    bits = (x >= 0).view(torch.uint8).reshape(*x.shape[:-1], -1, _BITS_PER_BYTE)
    packed = bits[..., 0] << 7
    for i in range(1, _BITS_PER_BYTE):
        packed |= bits[..., i] << (7 - i)
    return packed


_SIGN_TABLES: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _sign_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """A (256, 8) table: row ``b`` holds the eight signs (+1/-1) that byte ``b`` encodes."""
    key = (dtype, device)
    table = _SIGN_TABLES.get(key)
    if table is None:
        byte = torch.arange(256, dtype=torch.int64).unsqueeze(1)
        shifts = torch.arange(7, -1, -1, dtype=torch.int64)
        bits = (byte >> shifts) & 1
        table = (bits * 2 - 1).to(dtype=dtype, device=device)
        _SIGN_TABLES[key] = table
    return table


def unpack_signs(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`pack_signs`: bytes back to +1/-1 values of ``dtype``.

    The result has the leading dimensions of ``packed`` and a last dimension eight times larger.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_signs expects a uint8 tensor, got {packed.dtype}")
    table = _sign_table(dtype, packed.device)
    signs = table[packed.reshape(-1).long()]
    return signs.reshape(*packed.shape[:-1], packed.shape[-1] * _BITS_PER_BYTE)


def segment_scales(x: Tensor, segment_ids: Tensor, counts: Tensor) -> Tensor:
    """Scale of each segment, ``||x_seg||_2 / sqrt(count_seg)``, zero for a segment with no element.

    ``x`` is flat with masked entries already zero; ``segment_ids[i]`` is the segment of ``x[i]``;
    ``counts`` (float) holds the number of unmasked elements of each segment.
    """
    squares = torch.zeros(counts.numel(), dtype=x.dtype, device=x.device)
    squares.index_add_(0, segment_ids, x * x)
    return torch.where(counts > 0, squares.sqrt() / counts.clamp(min=1).sqrt(), torch.zeros_like(squares))


@dataclass(frozen=True)
class ChunkLayout:
    """How a flat vector of ``numel`` real elements is padded, chunked and cut into segments.

    Attributes:
        numel: number of real elements.
        world_size: number of chunks (one per rank).
        chunk: elements per chunk, a multiple of 8 (``0`` for an empty vector).
        segments_per_chunk: ``S``, the largest number of segments in a chunk; segment ``j`` of
            chunk ``k`` has index ``k * S + j`` (unused indices have no elements).
        segment_ids: int64, ``padded`` long: the segment index of every element.
        segment_counts: float, ``world_size * S`` long: unmasked elements per segment.
        mask: float, ``padded`` long: 1 where an element takes part in compression, 0 on padding
            and on caller-masked elements.
        fully_unmasked: ``True`` when only padding is masked.
    """

    numel: int
    world_size: int
    chunk: int
    segments_per_chunk: int
    segment_ids: Tensor
    segment_counts: Tensor
    mask: Tensor
    fully_unmasked: bool

    @property
    def padded(self) -> int:
        return self.world_size * self.chunk

    @property
    def chunk_bytes(self) -> int:
        return self.chunk // _BITS_PER_BYTE

    def chunk_segment_ids(self, k: int) -> Tensor:
        """Segment ids of chunk ``k``'s elements, relative to the chunk (``0 .. S-1``)."""
        return self.segment_ids[k * self.chunk : (k + 1) * self.chunk] - k * self.segments_per_chunk

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
        mask = torch.zeros(padded, dtype=torch.float32, device=device)
        if element_mask is None:
            mask[:numel] = 1.0
            fully_unmasked = True
        else:
            flat = element_mask.reshape(-1)
            if flat.numel() != numel:
                raise ValueError(f"element_mask has {flat.numel()} elements, expected {numel}")
            mask[:numel] = flat.to(device=device, dtype=torch.float32)
            fully_unmasked = bool((flat != 0).all())
        if padded == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return cls(numel, world_size, 0, 1, empty, torch.zeros(world_size, device=device), mask, True)
        starts = sorted({int(o) for o in segment_starts if 0 < o < numel} | {k * chunk for k in range(world_size)})
        chunk_of = [o // chunk for o in starts]
        per_chunk = [0] * world_size
        for k in chunk_of:
            per_chunk[k] += 1
        s_max = max(per_chunk)
        position, seen = [], [0] * world_size
        for k in chunk_of:
            position.append(k * s_max + seen[k])
            seen[k] += 1
        lengths = [b - a for a, b in zip(starts, starts[1:] + [padded])]
        segment_ids = torch.repeat_interleave(
            torch.tensor(position, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
        ).to(device)
        counts = torch.zeros(world_size * s_max, dtype=torch.float32, device=device)
        counts.index_add_(0, segment_ids, mask)
        return cls(numel, world_size, chunk, s_max, segment_ids, counts, mask, fully_unmasked)
