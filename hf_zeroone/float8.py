"""Float8 messages of exact steps (``exact_step_dtype="float8_e4m3fn"``): a block-scaled codec.

A second codec beside the 1-bit one of :mod:`hf_zeroone.compression`: a vector is cut into blocks of
:data:`FLOAT8_BLOCK` elements and each block ``b`` travels as one byte per element, ``x * 2**-e_b``
rounded to the nearest ``float8_e4m3fn``, and one byte for ``e_b``, the smallest integer with
``max|x_b| * 2**-e_b <= 448`` (448: that format's largest value), as in the OCP microscaling
formats. A power-of-two scale is exact, so each element keeps three bits of mantissa (a relative
error of at most ``2**-4``) unless it is more than ``2**13`` times smaller than its block's largest
(below that, float8's subnormals: coarser, down to zero at ``2**-17``), and the scale costs a byte
per block, not four. A block that holds a non-finite value gets the exponent byte -128 and decodes
to NaN.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from hf_zeroone.compression import _take

__all__ = ["FLOAT8_BLOCK", "decode_float8", "encode_float8", "encode_float8_into"]

#: elements per one-byte scale exponent of a float8 message (the scales add 1/FLOAT8_BLOCK bytes per element)
FLOAT8_BLOCK = 128
_FLOAT8_MAX = 448.0  # the largest finite float8_e4m3fn
_NAN_EXPONENT = -128  # a block with a non-finite element


def encode_float8(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(codes, exponents)`` of float32 ``x`` (flat, a whole number of :data:`FLOAT8_BLOCK` blocks).

    ``codes``: uint8, one per element (the bits of ``float8_e4m3fn`` of ``x * 2**-e``);
    ``exponents``: uint8, one per block, the bits of the int8 ``e`` (-128 for a block with a
    non-finite element). An all-zero block has ``e = 0`` and zero codes.
    """
    _check_float8_input(x)
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    exponents = encode_float8_into(x.clone(), codes)
    return codes, exponents


def _check_float8_input(x: Tensor) -> None:
    if x.dtype != torch.float32 or x.dim() != 1 or x.numel() % FLOAT8_BLOCK:
        what = f"{x.dtype} {tuple(x.shape)}"
        raise ValueError(f"encode_float8 needs a flat float32 tensor of whole {FLOAT8_BLOCK}-element blocks: {what}")


def encode_float8_into(x: Tensor, codes: Tensor) -> Tensor:
    """:func:`encode_float8` writing the codes into ``codes``; returns the exponents.

    ``x`` (flat float32, whole blocks) is overwritten: it is scaled in place, one pass fewer and
    no new vector of its size. ``codes``: uint8 with as many elements as ``x`` (which is read in
    ``codes``' shape), possibly a strided view (the rows of a message).
    """
    _check_float8_input(x)
    if codes.dtype != torch.uint8 or codes.numel() != x.numel():
        raise ValueError(f"codes must be uint8 with {x.numel()} elements, got {codes.dtype} {tuple(codes.shape)}")
    blocks = x.view(-1, FLOAT8_BLOCK)
    # max |x| = max(max x, -min x), without a new |x| per element (aminmax with a dim is slower on CPU)
    amax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())
    finite = torch.isfinite(amax)
    mantissa, exponent = torch.frexp(amax / _FLOAT8_MAX)  # amax / 448 = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent.sub_((mantissa == 0.5).to(exponent.dtype)).clamp_(-127, 127)  # ceil(log2(amax / 448))
    exponent = exponent.masked_fill_(~finite, _NAN_EXPONENT).to(torch.int8)
    # x * 2**-e, as torch.ldexp computes it (a product with a power of two: exact)
    blocks.mul_(torch.pow(2.0, -exponent.to(torch.float32)).unsqueeze(1))
    blocks.clamp_(-_FLOAT8_MAX, _FLOAT8_MAX)
    codes.view(torch.float8_e4m3fn).copy_(x.view(codes.shape))
    return exponent.view(torch.uint8)


_FLOAT8_VALUES: list[np.ndarray] = []  # the float32 value of each of the 256 float8_e4m3fn codes


def _float8_to_float32(codes: Tensor, out: Tensor | None = None) -> Tensor:
    """The float32 value of each float8_e4m3fn code (uint8, flat): a new tensor, or ``out`` (flat, contiguous).

    On the CPU torch converts element by element, most of a float8 allreduce's time; a lookup in
    a 256-entry table of torch's own conversions gives the same bits (NaN codes included) faster.
    Other devices convert.
    """
    if codes.device.type != "cpu":
        values = codes.view(torch.float8_e4m3fn)
        return values.to(torch.float32) if out is None else out.copy_(values)
    if not _FLOAT8_VALUES:
        every_code = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _FLOAT8_VALUES.append(every_code.view(torch.float8_e4m3fn).to(torch.float32).numpy())
    flat = codes.contiguous().numpy()
    values = _take(_FLOAT8_VALUES[0], flat, np.empty(flat.size, np.float32) if out is None else out.numpy())
    return torch.from_numpy(values) if out is None else out


def decode_float8(codes: Tensor, exponents: Tensor, out: Tensor | None = None) -> Tensor:
    """float32 values of :func:`encode_float8`'s ``codes`` and ``exponents`` (uint8, flat).

    A new tensor, or ``out`` (flat, contiguous float32, one element per code) written in place.
    """
    if out is not None and (out.dtype != torch.float32 or not out.is_contiguous() or out.shape != codes.shape):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {tuple(codes.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")  # fmt: skip
    exponent = exponents.view(torch.int8)
    # 2**e per block, as torch.ldexp computes it, and NaN for a block marked non-finite: one
    # in-place product per element makes the whole block NaN (a NaN factor spares no element)
    factors = torch.pow(2.0, exponent.to(torch.float32)).masked_fill_(exponent == _NAN_EXPONENT, math.nan)
    values = _float8_to_float32(codes, out).view(-1, FLOAT8_BLOCK)
    values.mul_(factors.unsqueeze(1))
    return values.view(-1) if out is None else out
