"""The kernels' decompressions (eight signs a byte, as vectors) give torch's bits on every value class.

``decompress_`` and ``decompress_sum_`` (the server's sum, and its fused form with norms) against
torch's unpacking and arithmetic: segments that start and end inside a byte, scales and error
values of every float32 class (zeros of both signs, subnormals, infinities, NaN, negatives),
with and without a mask, one to three rows.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_cpu_kernels import _SPECIALS, _own_norm_restored, _same, kernels, pytestmark  # noqa: F401 - the fixtures, the skip

from hf_zeroone import _cpu_kernels, compression

_SIZES = (3, 0, 13, 1, 2048, 8, 4101, 7, 64, 2)  # segments starting and ending inside bytes and blocks
_SCALES = [0.5, -0.0, 1e-45, float("inf"), 3.4e38, float("nan"), -2.0, 0.0, 1e-38, 7.0]


def _torch_copy(packed: torch.Tensor, scales: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    signs = compression._unpack_signs_elementwise(packed, torch.float32).reshape(-1)
    return torch.cat([signs[a:b] * s for s, a, b in zip(scales, bounds, bounds[1:])])


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_the_decompressions_are_torchs_bits(rows: int) -> None:
    bounds = [0, *itertools.accumulate(_SIZES)]
    n = bounds[-1]
    nb = (n + 7) // 8
    gen = torch.Generator().manual_seed(rows)
    packed = torch.randint(0, 256, (rows, nb + 3), dtype=torch.uint8, generator=gen)  # spare bytes after the signs
    scales = torch.tensor(_SCALES * rows)[torch.randperm(len(_SCALES) * rows, generator=gen)]
    error = torch.randn(n, generator=gen)
    error[torch.randint(0, n, (len(_SPECIALS),), generator=gen)] = torch.tensor(_SPECIALS)
    mask = (torch.rand(n, generator=gen) > 0.3).to(torch.uint8)
    k = len(_SIZES)
    copies = [_torch_copy(packed[r, :nb].contiguous(), scales[r * k : (r + 1) * k], bounds)[:n] for r in range(rows)]
    summed = copies[0] + error
    for c in copies[1:]:
        summed += c
    padded = bounds[:-1] + [8 * nb]  # decompress_ takes whole bytes: the last segment runs on to the last one
    one = _torch_copy(packed[0, :nb].contiguous(), scales[:k], padded)
    for m in (None, mask):
        out = torch.full((8 * nb,), 123.0)
        pad_mask = None if m is None else torch.cat([m, torch.ones(8 * nb - n, dtype=torch.uint8)])
        assert _cpu_kernels.decompress_(packed[0, :nb].contiguous(), scales[:k], padded, out, pad_mask)
        assert _same(out, one if m is None else one * pad_mask)
        out = torch.full((n,), 123.0)
        assert _cpu_kernels.decompress_sum_(packed, scales, bounds, error, out, m)
        assert _same(out, summed if m is None else summed * m)
        if _cpu_kernels._own_norm:  # the fused form, with the segments' norms
            fused = torch.full((n,), 123.0)
            assert _cpu_kernels.decompress_sum_norms_(packed, scales, bounds, error, fused, m, n) is not None
            assert _same(fused, out)
