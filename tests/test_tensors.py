import pytest
import torch

from hf_zeroone._tensors import all_finite


def test_all_finite_finds_any_nan_or_inf():
    x = torch.randn(1000)
    assert all_finite([x, torch.zeros(0), torch.randn(3, 4)])
    assert all_finite([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[517] = bad
        assert not all_finite([x, y])
    y = x.clone()
    y[1], y[2] = float("inf"), -float("inf")  # the sum is NaN, not inf
    assert not all_finite([y])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_is_not_fooled_by_an_overflowing_sum(dtype):
    big = torch.finfo(dtype).max
    finite = torch.full((64,), big, dtype=dtype)  # the sum overflows, every element is finite
    assert all_finite([finite])
    assert not all_finite([torch.cat([finite, torch.tensor([float("inf")], dtype=dtype)])])
