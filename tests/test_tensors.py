import math

import pytest
import torch

from hf_zeroone._tensors import add_scalar_, all_finite, div_scalar_, mul_scalar, mul_scalar_, non_finite_flag


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_scalar_helpers_give_the_bits_of_torchs_own_multi_tensor_ops(dtype):
    """The helpers pass the number in a faster form on CPU: the results must not move by a bit."""
    gen = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(n, generator=gen) * 10.0**e).to(dtype) for n, e in ((3, -7), (1000, 0), (4097, 2))]
    values = (1.0001, 3.7, 0.1, 1 / 3, 1e-8, math.sqrt(1 - 0.999**7), -1e-3 / 0.3, 1e-30)
    for value in values:
        for ours, torchs in (
            (mul_scalar_, torch._foreach_mul_),
            (div_scalar_, torch._foreach_div_),
            (add_scalar_, torch._foreach_add_),
        ):
            got, want = [t.clone() for t in tensors], [t.clone() for t in tensors]
            ours(got, value)
            torchs(want, value)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (ours.__name__, dtype, value)
        made = mul_scalar(tensors, value)
        assert all(torch.equal(a, b) for a, b in zip(made, torch._foreach_mul(tensors, value)))
        assert all(m is not t for m, t in zip(made, tensors))  # new tensors, the inputs untouched
