import pytest
import torch

from hf_zeroone._tensors import all_finite, non_finite_flag


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_non_finite_flag_agrees_with_all_finite_without_a_host_read(dtype):
    big = torch.finfo(dtype).max
    cases = [torch.randn(300).to(dtype), torch.full((64,), big, dtype=dtype), torch.zeros(0, dtype=dtype)]
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = torch.randn(300).to(dtype)
        y[123] = bad
        cases.append(y)
    for t in cases:
        flag = non_finite_flag(t.view(-1, 1) if t.numel() else t)
        assert flag.dtype == torch.float32 and flag.shape == (1,) and flag.device == t.device
        assert flag.item() == (0.0 if all_finite([t]) else 1.0)
