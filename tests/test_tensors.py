import math

import pytest
import torch

from hf_zeroone._tensors import add_scalar_, all_finite, div_scalar_, flat_span, mul_scalar, mul_scalar_
from hf_zeroone.ddp_hook import non_finite_flag


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


def test_shape_groups_keep_first_seen_order_split_by_dtype_and_bound_their_size(monkeypatch):
    import hf_zeroone._tensors as T

    ts = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)]
    ts += [torch.zeros(2, 3), torch.zeros(4)]
    assert T.shape_groups(ts, range(6)) == [[0, 2, 4], [1, 5], [3]]
    assert T.shape_groups(ts, [5, 4, 1]) == [[5, 1], [4]]
    monkeypatch.setattr(T, "GROUP_ELEMENTS", 12)  # two 2x3 tensors per group at most; a larger one alone
    assert T.shape_groups(ts + [torch.zeros(20)], [0, 2, 4, 6]) == [[0, 2], [4], [6]]


def _reference_denominators(vs, c2, eps, factors):
    """Tensor by tensor: sqrt(v) / sqrt(c2) + eps, or sqrt(v) * sqrt(f / c2) + eps with a factor (in v's dtype)."""
    out = []
    for v, f in zip(vs, factors):
        d = v.sqrt()
        d = d / torch.tensor(math.sqrt(c2), dtype=v.dtype) if f is None else d * (f / c2).sqrt().to(v.dtype)
        out.append(d + torch.tensor(eps, dtype=v.dtype))
    return out


def test_a_group_mixing_dtypes_gets_each_tensors_factor_in_its_own_dtype():
    """A bf16 tensor first must not round an fp32 tensor's variance factor to bf16 (nor the reverse)."""
    from hf_zeroone.optim import _functional as F

    g = torch.Generator().manual_seed(3)
    vs = [torch.rand(4, 3, generator=g).to(torch.bfloat16), torch.rand(4, 3, generator=g), torch.rand(5, generator=g)]
    factors = [torch.tensor(1.2345678), torch.tensor(0.7654321), torch.tensor(2.3456789)]
    for d, ref in zip(F.denominators(vs, 0.37, 1e-8, factors), _reference_denominators(vs, 0.37, 1e-8, factors)):
        assert d.dtype == ref.dtype and torch.equal(d, ref)


def _reference_scale_samples(grads, dens, means, counts, idle, idle_below):
    q = []
    for i, (g, d) in enumerate(zip(grads, dens)):
        r = g.float() / d
        if idle is None or idle[i]:
            r = r.masked_fill(d < means[i] * idle_below, 0.0)
        q.append(torch.linalg.vector_norm(r))
    return torch.stack(q).square() / counts


@pytest.mark.parametrize("group_elements", [1 << 22, 40])
def test_stacked_per_tensor_operands_give_the_tensor_by_tensor_bits(monkeypatch, group_elements):
    """The variance factors and the idle thresholds, applied one call per shape, give a loop over tensors' bits."""
    import hf_zeroone._tensors as T
    from hf_zeroone.optim import _functional as F
    from hf_zeroone.optim import _grad_scale as GS

    monkeypatch.setattr(T, "GROUP_ELEMENTS", group_elements)
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (7, 5), (3,), (7, 5), (3,), (2, 2, 2), (1,), (0,), (7, 5)]
    vs = [torch.rand(s, generator=g) ** 4 for s in shapes]
    for v in vs[:4]:
        v.view(-1)[:2] = 0.0  # idle elements
    factors = [torch.rand((), generator=g) * 3 for _ in shapes]
    factors[2] = factors[6] = None
    dens = F.denominators(vs, 0.37, 1e-8, factors)
    for d, ref in zip(dens, _reference_denominators(vs, 0.37, 1e-8, factors)):
        assert d.shape == ref.shape and torch.equal(d.view(torch.int32), ref.view(torch.int32))
    grads = [torch.randn(s, generator=g) for s in shapes]
    means, counts, idle = GS.sample_statistics(dens)
    assert any(idle.tolist()) and not all(idle.tolist())
    for which in (None, idle.tolist(), [True] * len(shapes), [False] * len(shapes)):
        got = GS.scale_samples(grads, dens, means, counts, which)
        assert torch.equal(got, _reference_scale_samples(grads, dens, means, counts, which, GS.IDLE_BELOW))


def test_layout_order_is_memory_order_where_dense_and_row_major_elsewhere():
    """The order DDP lays a gradient in its bucket (``layout_view``): the parameter's own memory order if dense."""
    from hf_zeroone.optim._flat import layout_order, layout_view

    base = torch.arange(24.0)
    dense = {
        "transposed": base.view(4, 6).t(),
        "channels_last": base.view(1, 2, 3, 4).contiguous(memory_format=torch.channels_last),
        "size-1 dims": base.view(6, 1, 4).transpose(0, 2),
    }
    for name, t in dense.items():
        assert not t.is_contiguous(), name
        memory = torch.empty(0).set_(t.untyped_storage(), 0, (t.numel(),))  # the storage as laid out
        assert torch.equal(layout_order(t, t), memory), name
        flat = torch.zeros(t.numel() + 3)
        layout_view(flat, 3, t).copy_(t)  # written through the view: the same order, from offset 3
        assert torch.equal(flat[3:], memory), name
    for name, t in {"contiguous": base.view(4, 6), "a slice": base.view(4, 6)[:, :3]}.items():
        assert torch.equal(layout_order(t, t), t.reshape(-1)), name


def test_per_tensor_operands_on_views_of_one_vector_are_one_operation_with_the_per_tensor_bits():
    """``apply_per_tensor`` in place on pieces that tile a vector: the span at once, as tensor by tensor."""
    from hf_zeroone._tensors import apply_per_tensor, flat_span
    from hf_zeroone.optim._flat import layout_views

    g = torch.Generator().manual_seed(2)
    shapes = [(3, 4), (5,), (0,), (2, 2, 2), (1,)]
    flat = torch.randn(40, generator=g)
    likes = [torch.empty(s) for s in shapes]
    offsets = [0, 12, 17, 17, 25]
    views = layout_views(flat, offsets, likes)
    assert flat_span(views).data_ptr() == flat.data_ptr() and flat_span(views).numel() == 26
    assert flat_span(views[::-1]) is None  # not in order
    assert flat_span([views[0], views[3]]) is None  # a gap between them
    assert flat_span([flat[:4].view(torch.int32)]) is None  # another dtype than the vector's
    factors = torch.rand(len(shapes), generator=g) + 0.5
    want = [v * f for v, f in zip(views, factors.unbind())]
    rest = flat[26:].clone()
    apply_per_tensor("mul", views, factors, in_place=True)
    for v, w in zip(views, want):
        assert torch.equal(v, w)
    assert torch.equal(flat[26:], rest)  # nothing past the last piece


@pytest.mark.parametrize("shapes", [[(8, 8)] * 12, [(3,)] + [(8, 8)] * 9 + [(0,), (5, 2)] + [(8, 8)] * 8])
@pytest.mark.parametrize("op", ["mul", "div"])
def test_per_tensor_operands_on_runs_of_same_sized_views_have_the_per_tensor_bits(shapes, op):
    """Same-sized pieces of a span (a bucket of one layer's weights) take their operands a run at a time."""
    from hf_zeroone._runs import few, runs
    from hf_zeroone._tensors import apply_per_tensor
    from hf_zeroone.optim._flat import layout_views

    g = torch.Generator().manual_seed(len(shapes))
    likes = [torch.empty(s) for s in shapes]
    offsets = [sum(t.numel() for t in likes[:i]) for i in range(len(likes))]
    flat = torch.randn(offsets[-1] + likes[-1].numel() + 3, generator=g)
    views = layout_views(flat, offsets, likes)
    assert few(runs([t.numel() for t in likes]))
    factors = torch.rand(len(shapes), generator=g) + 0.5
    want = [getattr(v, op)(f) for v, f in zip(views, factors.unbind())]
    apply_per_tensor(op, views, factors, in_place=True)
    for v, w in zip(views, want):
        assert torch.equal(v, w)


@pytest.mark.parametrize("reverse", [False, True])
def test_pieces_of_interleaved_shapes_are_the_tensors_laid_end_to_end_one_view_per_evenly_spaced_run(reverse):
    """A layer's weight and bias in every layer: two strided views, unbound, not a view per tensor."""
    from hf_zeroone._runs import pieces

    shapes = [(8, 8), (8,)] * 6 + [(3, 2), (), (0,), (8, 8), (6,), (8,), (3, 2)]
    likes = [torch.empty(s) for s in shapes]
    laid = likes[::-1] if reverse else likes
    vector = torch.arange(3.0, 3.0 + sum(t.numel() for t in likes) + 5)[3:-2]  # a view inside a larger tensor
    want = [p.view(t.shape) for p, t in zip(vector.split([t.numel() for t in laid]), laid)]
    want = want[::-1] if reverse else want
    with torch.profiler.profile() as prof:
        got = pieces(vector, likes, reverse)
    assert [g.shape for g in got] == [t.shape for t in likes]
    for g, w in zip(got, want):
        assert g.data_ptr() == w.data_ptr() and torch.equal(g, w)
    assert flat_span(got[::-1] if reverse else got) is not None  # still one span, for one operation on all
    strided = sum(e.name == "aten::as_strided" and e.cpu_parent is None for e in prof.events())
    assert strided <= 9  # runs: 12 of (8, 8) and (8,) each, then a few odd ones


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shapes", [[(8, 8), (8,)] * 6, [(8, 8), (8,), (), (0,), (5, 3), (8,)] * 3 + [(7,)]])
def test_flat_state_gives_the_denominators_and_statistics_of_separate_tensors_bit_for_bit(shapes, reverse):
    """A variance laid out as one vector's pieces (the optimizer's flat state; reversed: a DDP bucket's order) goes
    a run at a time, with the bits of the same values held tensor by tensor: the denominators, their means and their
    counts of active elements."""
    from hf_zeroone._tensors import tiling, zeros_like_flat
    from hf_zeroone.optim._functional import split_denominators
    from hf_zeroone.optim._grad_scale import sample_statistics

    g = torch.Generator().manual_seed(len(shapes))
    likes = [torch.empty(s) for s in shapes]
    flat = zeros_like_flat(likes)
    assert flat_span(flat) is not None
    for v in flat:
        v.copy_(torch.rand(v.shape, generator=g).pow(6) * 1e-4)  # many elements far below their tensor's mean
    flat = flat[::-1] if reverse else flat
    alone = [v.clone() for v in flat]
    factors = torch.rand(len(shapes), generator=g) + 0.5
    got, want = split_denominators(flat, 0.9, 1e-8, factors), split_denominators(alone, 0.9, 1e-8, factors)
    for dens in got:  # computed on one vector
        span, reversed_ = tiling(dens)
        assert span is not None and reversed_ == reverse
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert a.shape == b.shape and torch.equal(a, b)
    for a, b in zip(sample_statistics(got[0], 1e-8), sample_statistics(want[0], 1e-8)):
        assert torch.equal(a, b)
