"""The per-tensor statistics of a compressed step cost a fixed number of torch calls, whatever the tensor count.

On a GPU every torch call on a 0-dim per-tensor value is a kernel launch and some microseconds of
host work. These functions work on one vector for all tensors (norms, norm-proxy factors and
clipping fractions); the tests count the torch functions they call (reads of shapes, sizes and
dtypes left out), for a few tensors and for many, and check that the count does not grow with the
tensor count. They also pin the results against the per-tensor formulas, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import hf_zeroone._tensors as T
from hf_zeroone._tensors import float32_norms
from hf_zeroone.optim import _functional as F
from hf_zeroone.optim._grad_scale import IDLE_BELOW, kept_fraction, sample_statistics

#: reads of a tensor's metadata: host work, never a kernel launch
_METADATA = {"numel", "dim", "size"}


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        if not name.endswith("__get__") and name not in _METADATA:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _calls(fn, *args) -> int:  # noqa: ANN001
    with _Calls() as mode:
        fn(*args)
    return mode.count


def _tensors(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (33,), (4, 4, 3), (1,), (0,)]
    return [torch.randn(shapes[i % len(shapes)], generator=gen) for i in range(n)]


def test_norms_and_norm_proxies_make_as_many_calls_for_many_tensors_as_for_few():
    for fn, make in (
        (F.local_sq_norms, lambda n: (_tensors(n),)),
        (float32_norms, lambda n: (_tensors(n),)),
        (F.norm_proxy_factors, lambda n: (_tensors(n), torch.rand(n))),
    ):  # 30 tensors: each of the 5 shapes more than once (a stack per shape)
        few, many = _calls(fn, *make(30)), _calls(fn, *make(120))
        assert many <= few + 2, f"{fn.__name__}: {few} torch calls for 30 tensors, {many} for 120"


def test_the_vector_forms_give_the_per_tensor_results_bit_for_bit():
    ts = _tensors(11) + [None] + _tensors(12, seed=4) + [None]
    squares = F.local_sq_norms(ts)
    for t, sq in zip(ts, squares):
        expected = torch.zeros(()) if t is None else torch.linalg.vector_norm(t, dtype=torch.float32) ** 2
        assert torch.equal(sq, expected)
    low = [t.bfloat16() for t in _tensors(9, seed=1)]  # cast as they are reduced, not copied
    for t, norm in zip(low, float32_norms(low)):
        assert torch.equal(norm, torch.linalg.vector_norm(t.float()))

    views = _tensors(23, seed=2)
    views[3].zero_()
    views[5][0] = float("inf")
    mean_sq = torch.rand(23)
    mean_sq[7] = 0.0
    mean_sq[9] = float("nan")
    before = [v.clone() for v in views]
    factors, handed_norms = F.norm_proxy_factors(views, mean_sq)
    for v, old, m, factor, handed in zip(views, before, mean_sq, factors, handed_norms):
        norm = torch.linalg.vector_norm(old)
        ok = (norm > 0) & (m > 0) & torch.isfinite(norm)
        assert torch.equal(factor, torch.where(ok, m.sqrt() / norm, torch.ones_like(norm)))
        assert torch.equal(handed, torch.where(ok, m.sqrt(), norm))
        assert torch.allclose(v, old * factor, rtol=0, atol=0, equal_nan=True)  # the same bits, NaN included

    ratios = torch.tensor([1.0, 1.0 - 1e-6, 0.5, 1.5])
    assert torch.equal(kept_fraction(ratios), torch.tensor([1.0, 1.0, 0.5, 1.0]))


def test_sample_statistics_means_are_each_tensors_mean_denominator():
    dens = [t.abs() + 1e-3 for t in _tensors(11, seed=3)] + [torch.full((40_000,), 0.37)]
    means, counts, idle = sample_statistics(dens)
    for d, mean, count, flag in zip(dens, means, counts, idle):
        expected = torch.linalg.vector_norm(d, 1) / max(d.numel(), 1)
        assert torch.equal(mean, expected)
        active = int(d.ge(expected * IDLE_BELOW).sum())
        assert count == max(active, 1) and bool(flag) == (active < d.numel())


def test_the_active_counts_are_the_per_tensor_counts_in_a_few_calls():
    """The idle counts of :func:`sample_statistics` are one comparison per shape, with a loop's integers.

    They are rebuilt on every step where ``v`` moves (exact steps of several ranks, 0/1 Adam's
    variance updates).
    """
    from hf_zeroone.optim._grad_scale import idle_floors

    dens = [t.abs() for t in _tensors(40, seed=4)] + [torch.tensor(0.5), torch.tensor(0.0)]  # 0-dim too
    dens[1], dens[2] = dens[1].bfloat16(), dens[2].double()  # compared in their own dtype
    for d in dens[:20]:
        d.view(-1)[:1] = 0.0  # idle elements
    means, counts, idle = sample_statistics(dens, 1e-8)
    want = torch.stack([d.ge(f).sum() for d, f in zip(dens, idle_floors(means, 1e-8).unbind())])
    assert torch.equal(counts, want.float().clamp(min=1.0))
    assert torch.equal(idle, want < torch.tensor([d.numel() for d in dens]))
    assert 0 < int(idle.sum()) < len(dens)

    few, many = (_calls(sample_statistics, [t.abs() for t in _tensors(n, seed=5)]) for n in (6, 120))
    assert many <= few + 2, f"{few} torch calls for 6 tensors, {many} for 120"


def test_the_momentum_lerps_give_the_per_tensor_bits_on_the_flat_bucket():
    """1-bit Adam's momentum message and its implied gradient are one lerp each on the flat bucket,
    with a per-tensor loop's bits."""
    ms, gs, outs = _tensors(30, seed=5), _tensors(30, seed=6), _tensors(30, seed=7)
    flat_m, flat_g = torch.cat([m.reshape(-1) for m in ms]), torch.cat([g.reshape(-1) for g in gs])
    message = torch.empty_like(flat_m)
    F.onebit_message(message, flat_g, 0.999, None, flat_m, 0.9)
    assert torch.equal(message, torch.cat([m.lerp(g, 0.1).reshape(-1) for m, g in zip(ms, gs)]))

    implied = torch.cat([o.reshape(-1) for o in outs])
    F.implied_gradients(flat_m, implied, 0.9)
    want = torch.cat([torch.lerp(m, o, 1.0 / (1.0 - 0.9)).reshape(-1) for m, o in zip(ms, outs)])
    assert torch.equal(implied, want)


def test_per_tensor_operands_applied_by_shape_give_the_multi_tensor_bits():
    """The stacked form of ``t * f`` / ``t / f`` equals the multi-tensor call, in place or not."""

    gen = torch.Generator().manual_seed(8)
    tensors = _tensors(25, seed=9)
    tensors[3], tensors[8] = tensors[3].bfloat16(), tensors[8].bfloat16()  # rounded operands in their dtype
    operands = [torch.rand((), generator=gen) * 3 + 0.1 for _ in tensors]
    for op in ("mul", "div"):
        copies = [t.clone() for t in tensors]
        assert T.apply_per_tensor(op, copies, operands, in_place=True) is not None
        want = getattr(torch, f"_foreach_{op}")(tensors, operands)
        for got in (copies, T.apply_per_tensor(op, tensors, operands, in_place=False)):
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and torch.equal(a, b)

    numbers = [0.5 + i / 7 for i in range(len(tensors))]  # host numbers: one multi-tensor call
    divided = T.apply_per_tensor("div", tensors, numbers, in_place=False)
    for got, want in zip(divided, torch._foreach_div(tensors, numbers)):
        assert torch.equal(got, want)

    small, large = (_tensors(n) for n in (10, 200))  # a call or a few per shape, not per tensor
    few = _calls(T.apply_per_tensor, "mul", small, [torch.tensor(2.0)] * 10, True)
    many = _calls(T.apply_per_tensor, "mul", large, [torch.tensor(2.0)] * 200, True)
    assert many <= few + 2, (few, many)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("reverse", [False, True])
def test_per_tensor_operands_on_a_vectors_pieces_in_either_order_work_on_the_vector(reverse, in_place):
    """A DDP bucket's pieces come in reverse parameter order: the operands still apply to the vector they tile, in
    place or into one new vector, with the tensor-by-tensor bits; no tensor is stacked or copied back."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_zeroone.optim._flat import layout_views

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    for pieces in (9, 90):  # operands repeated over the vector; a run of same-sized pieces at a time
        g = torch.Generator().manual_seed(pieces)
        likes = [torch.empty(s) for s in [(3, 4), (5,), (0,), (2, 2, 2), (1,)] + [(4, 2)] * pieces]
        offsets = [sum(t.numel() for t in likes[:i]) for i in range(len(likes))]
        flat = torch.randn(offsets[-1] + 8, generator=g)
        views = layout_views(flat, offsets, likes)
        views = views[::-1] if reverse else views
        factors = torch.rand(len(views), generator=g) + 0.5
        want = [v / f for v, f in zip(views, factors.unbind())]
        before = flat.clone()
        with Ops() as mode:
            got = T.apply_per_tensor("div", views, list(factors.unbind()), in_place=in_place)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b)
        assert mode.names.count("stack") == 1 and "_foreach_copy_" not in mode.names, mode.names  # the operands
        assert mode.names.count("div_") <= 6 and mode.names.count("view") <= 12, mode.names  # not one per piece
        if not in_place:
            assert torch.equal(flat, before)
            assert T.flat_span(got[::-1] if reverse else got) is not None  # pieces of one new vector


class _Outputs(TorchFunctionMode):
    """Counts the tensor objects torch calls return (an ``unbind`` of ``n`` rows makes ``n``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        items = out if isinstance(out, (tuple, list)) else [out]
        self.count += sum(isinstance(item, torch.Tensor) for item in items)
        return out


def test_scale_samples_with_idle_elements_make_no_tensor_per_tensor():
    """Samples of tensors with idle elements are reduced per shape group: no view per tensor is made.

    The foreach form makes a quotient per tensor; the masked form, taken as soon as one tensor has
    an idle element, makes a fixed number of tensors whatever the tensor count.
    """
    from hf_zeroone.optim._grad_scale import scale_samples

    def outputs(n: int) -> int:
        dens = [t.abs() + 0.01 for t in _tensors(n, seed=6)]
        dens[0].view(-1)[:1] = 0.0  # one idle element: the masked form
        grads = _tensors(n, seed=7)
        means, counts, idle = sample_statistics(dens)
        with _Outputs() as mode:
            scale_samples(grads, dens, means, counts, idle.tolist())
        return mode.count

    few, many = outputs(30), outputs(120)
    assert many <= few + 4, f"{few} tensors made for 30 tensors, {many} for 120"


class _Bucket:
    """What the hook reads of a DDP bucket: its index and its flat buffer."""

    def __init__(self, index: int, buffer: torch.Tensor) -> None:
        self._index, self._buffer = index, buffer

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_a_buckets_gradient_views_are_made_once_and_again_after_a_rebuild():
    """The per-parameter views of a bucket's buffer are kept while DDP keeps the buffer, and only then."""
    from hf_zeroone import OneBitAdam, ZeroOneHookState

    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(4))]
    state = ZeroOneHookState(OneBitAdam(params, lr=1e-3))
    first = _Bucket(0, torch.arange(10.0))
    views = state.gradient_views(first, params)
    assert torch.equal(views[0], torch.arange(6.0).view(3, 2)) and torch.equal(views[1], torch.arange(6.0, 10.0))
    assert state.gradient_views(first, params) is views  # the same buffer: no new views
    other = _Bucket(1, torch.zeros(4))
    state.gradient_views(other, params[1:])
    rebuilt = _Bucket(0, torch.arange(10.0, 20.0))  # DDP rebuilt its buckets: a new buffer
    again = state.gradient_views(rebuilt, params)
    assert torch.equal(again[1], torch.arange(16.0, 20.0))
    assert list(state._views) == [0]  # the old buffers' views are gone with them
    reordered = state.gradient_views(rebuilt, params[::-1])  # other parameters in the same buffer
    assert reordered[0].shape == (4,) and torch.equal(reordered[0], torch.arange(10.0, 14.0))
