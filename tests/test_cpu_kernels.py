"""The fused CPU kernels (``hf_zeroone/_cpu_kernels.c``) give torch's bits, and everything works without them.

Each kernel is pinned against the torch operations it replaces, bit for bit, on values of every
float32 class (zeros of both signs, subnormals, the largest, infinities, NaN) and on sizes that do
and do not fill a vector register; both optimizers are pinned through every phase with the kernels
on and off. A library that a compiler built with other rounding is refused, a missing compiler
costs a warning and nothing else, and ``HF_ZEROONE_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from hf_zeroone import OneBitAdam, ZeroOneAdam, _cpu_kernels, _cpu_kernels_check, compression
from hf_zeroone._tensors import all_finite
from hf_zeroone.optim import _functional as F
from hf_zeroone.optim._grad_scale import scale_samples

from _dist import run_ranks

pytestmark = pytest.mark.skipif(
    shutil.which(_cpu_kernels._compiler()[0]) is None or not cpp_extension.is_ninja_available(),
    reason="no C++ compiler or ninja on this machine",
)

_SPECIALS = [0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38, float("inf"), -float("inf"), float("nan"), 1.0]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        return a.dtype == b.dtype and torch.equal(a, b)
    return _cpu_kernels_check.same(a.reshape(-1), b.reshape(-1))


def _lists(seed: int, sizes=(0, 1, 3, 16, 17, 63, 1000, 4099)):  # noqa: ANN001, ANN202
    gen = torch.Generator().manual_seed(seed)
    specials = torch.tensor(_SPECIALS)
    grads = [torch.cat([torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 3, (1,), generator=gen), specials])
             for n in sizes]  # fmt: skip
    roots = [torch.cat([torch.rand(n, generator=gen) * 1e-3, specials.abs()]) for n in sizes]
    return grads, roots


@pytest.fixture(autouse=True)
def _own_norm_restored(monkeypatch):  # noqa: ANN001, ANN202
    """Whatever a test's loads set the library's norm flag to, the next test finds it as it was."""
    monkeypatch.setattr(_cpu_kernels, "_own_norm", _cpu_kernels._own_norm)


@pytest.fixture
def kernels(monkeypatch):  # noqa: ANN001, ANN201
    """The kernels on, whatever the environment says (a fresh load in this process)."""
    monkeypatch.delenv("HF_ZEROONE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(_cpu_kernels, "_tried", False)
    monkeypatch.setattr(_cpu_kernels, "_library", None)
    assert _cpu_kernels.enabled()


class _Counting:
    """The compiled module, counting per function the calls it took (returned a result, or ``True``)."""

    def __init__(self, lib) -> None:  # noqa: ANN001
        self.lib, self.taken = lib, {}

    def __getattr__(self, name: str):  # noqa: ANN204
        fn = getattr(self.lib, name)

        def counted(*args):  # noqa: ANN002, ANN202
            out = fn(*args)
            if out is not None and out is not False and not (isinstance(out, int) and out < 0):
                self.taken[name] = self.taken.get(name, 0) + 1
            return out

        return counted


def _counting(monkeypatch) -> _Counting:  # noqa: ANN001
    counting = _Counting(_cpu_kernels._library_or_none())
    monkeypatch.setattr(_cpu_kernels, "_library", counting)
    return counting


def _kernels_off(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(_cpu_kernels, "_tried", True)
    monkeypatch.setattr(_cpu_kernels, "_library", None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_denominators_are_torchs_bits(kernels, monkeypatch, seed):  # noqa: ANN001
    _, roots = _lists(seed)
    v = [r * r for r in roots]
    c2, eps = 0.0951, 1e-8
    factors = [
        torch.tensor(f, dtype=torch.float32)
        for f in torch.rand(len(v), generator=torch.Generator().manual_seed(seed)).add(0.2).tolist()
    ]
    factors[3] = None  # a tensor without a scale (no gradient before the freeze): torch's form for the list
    mixed = F.split_denominators(v, c2, eps, factors)
    factors[3] = torch.tensor(1.5)
    fused_plain, fused_scaled = F.split_denominators(v, c2, eps, factors)
    fused_alone = F.denominators(v, c2, eps)
    fused_scaled_alone = F.denominators(v, c2, eps, factors)
    _kernels_off(monkeypatch)
    plain, scaled = F.split_denominators(v, c2, eps, factors)
    factors[3] = None
    assert all(map(_same, mixed[0], F.split_denominators(v, c2, eps, factors)[0]))
    assert all(map(_same, mixed[1], F.denominators(v, c2, eps, factors)))
    factors[3] = torch.tensor(1.5)
    assert all(map(_same, fused_plain, plain)) and all(map(_same, fused_scaled, scaled))
    assert all(map(_same, fused_alone, F.denominators(v, c2, eps)))
    assert all(map(_same, fused_scaled_alone, F.denominators(v, c2, eps, factors)))
    assert all(map(_same, plain, F.denominators(v, c2, eps)))  # the torch forms agree with each other too


@pytest.mark.parametrize("seed", [0, 1])
def test_clipping_and_the_scale_samples_are_torchs_bits(kernels, monkeypatch, seed):  # noqa: ANN001
    grads, roots = _lists(seed)
    dens = F.denominators([r * r for r in roots], 0.3, 1e-8)
    means = torch.stack([d.nan_to_num(posinf=1.0).mean() if d.numel() else torch.tensor(1.0) for d in dens])
    counts = torch.full((len(dens),), 7.0)
    idle = [i % 2 == 0 for i in range(len(dens))]
    clipped = F.clip_to_variance(grads, dens, 0.999)
    samples = [scale_samples(grads, dens, means, counts, mask, 1e-8) for mask in (idle, None)]
    # finite ratios too: every norm compared (NaN equals NaN in _same)
    bounded = [g.nan_to_num(0.0, 0.0, 0.0).clamp(-1e3, 1e3) for g in grads]
    finite_dens = [d.nan_to_num(1.0, 1.0, 1.0) for d in dens]
    finite_samples = scale_samples(bounded, finite_dens, means, counts, idle, 1e-8)
    assert torch.isfinite(finite_samples).all()
    checked = (
        grads,
        [torch.tensor([1e-45, -0.0, 3.4e38])],
        [torch.tensor([float("nan")])],
        [torch.zeros(0), torch.ones(3)],
    )
    finite = [all_finite(ts) for ts in checked]
    _kernels_off(monkeypatch)
    assert all(map(_same, clipped, F.clip_to_variance(grads, dens, 0.999)))
    assert _same(samples[0], scale_samples(grads, dens, means, counts, idle, 1e-8))
    assert _same(samples[1], scale_samples(grads, dens, means, counts, None, 1e-8))
    assert _same(finite_samples, scale_samples(bounded, finite_dens, means, counts, idle, 1e-8))
    assert finite == [all_finite(ts) for ts in checked]
    assert finite == [False, True, False, True]


def test_the_librarys_own_norm_is_torchs_on_every_remainder(kernels):  # noqa: ANN001
    """Where the load-time check took it: torch's norm bits on sizes the check did not try, at every magnitude.

    On the configuration it was written for (torch 2.13's x86 CPU build) the check must take it: a
    check that stopped passing there would lose the speed without a word.
    """
    known = torch.__version__.startswith("2.13.") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    assert _cpu_kernels._own_norm or not known
    if not _cpu_kernels._own_norm:
        pytest.skip("this torch build reduces in another order: its own norm is used (checked at load)")
    gen = torch.Generator().manual_seed(5)
    sizes = [*range(81, 300), 1024, 4099, 16384, 32767]
    tensors = [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-12, 12, (1,), generator=gen) for n in sizes]
    tensors += [torch.cat([torch.randn(40, generator=gen), torch.tensor([s])]) for s in _SPECIALS]
    tensors += [torch.tensor([s]) for s in [*_SPECIALS, -1.2612e-44, 2e-30, 3e20]]  # one element: its magnitude
    lib = _cpu_kernels._library_or_none()
    assert _same(lib.norms(tensors, 0), torch.stack(torch._foreach_norm(tensors)))


def _segments_of(sizes, seed: int):  # noqa: ANN001, ANN202
    """A flat vector cut into segments of ``sizes`` (values of every magnitude and class) and their bounds."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-12, 12, (1,), generator=gen) for n in sizes]
    x = torch.cat(parts)
    x[torch.randint(0, x.numel(), (len(_SPECIALS),), generator=gen)] = torch.tensor(_SPECIALS)
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return x, bounds


#: segments around the fused loops' blocks (2048 elements) and the norm's lanes (8)
_BLOCKED = (0, 1, 7, 8, 9, 2047, 2048, 2049, 2061, 4101, 4109, 6144, 5, 0, 12)


def test_the_signs_packed_inside_the_passes_are_pack_signs_bytes(kernels):  # noqa: ANN001
    """The worker's y = x + e_w and the server's sum pack their signs as they write: pack_signs' bytes, row by row.

    Chunks cut into segments of every remainder and across blocks; the rows' other bytes (the scales' place) are
    left as they were; arguments the pass cannot pack into are refused with nothing written.
    """
    if not _cpu_kernels._own_norm:
        pytest.skip("this torch build reduces in another order: the fused passes are not used (checked at load)")
    p, sizes = 3, (1, 7, 2061, 9, 4101, 5, 0, 12, 2048, 3)  # 8248 elements a chunk
    c = sum(sizes) + (-sum(sizes)) % 8
    parts = [_segments_of(sizes + (c - sum(sizes),), seed) for seed in range(p)]
    x = torch.cat([t for t, _ in parts])
    bounds = sorted({k * c + b for k, (_, bs) in enumerate(parts) for b in bs})
    gen = torch.Generator().manual_seed(2)
    e = torch.randn(x.numel(), generator=gen)
    mask = (torch.rand(x.numel(), generator=gen) > 0.3).to(torch.uint8)
    nb = c // 8
    for m in (mask, None):
        y, want = x.clone(), x.clone()
        send = torch.full((p, nb + 5), 0xAB, dtype=torch.uint8)
        norms = _cpu_kernels.add_masked_norms_(y, e, m, x.numel() - 4, bounds, signs=send)
        assert norms is not None
        assert _same(norms, _cpu_kernels.add_masked_norms_(want, e, m, x.numel() - 4, bounds))
        assert _same(y, want)
        assert torch.equal(send[:, :nb], compression._pack_signs_torch(want.view(p, c)))
        assert bool((send[:, nb:] == 0xAB).all())
    # a chunk that does not start a segment, signs that do not fit or overlap: refused, nothing written
    for case in ("a chunk inside a segment", "rows too short", "signs in y", "signs in e", "not rows"):
        y, e_, bad_bounds, signs = x.clone(), e.clone(), bounds, torch.zeros(p, nb, dtype=torch.uint8)
        if case == "a chunk inside a segment":
            bad_bounds = [0, 5, x.numel()]
        elif case == "rows too short":
            signs = signs[:, 1:].contiguous()
        elif case == "signs in y":
            signs = y.view(torch.uint8)[: p * nb].view(p, nb)
        elif case == "signs in e":
            signs = e_.view(torch.uint8)[: p * nb].view(p, nb)
        else:
            signs = signs.view(-1)
        assert _cpu_kernels.add_masked_norms_(y, e_, None, x.numel(), bad_bounds, signs=signs) is None, case
        assert _same(y, x) and _same(e_, e) and (case in ("signs in y", "signs in e") or not signs.any()), case

    rows = torch.stack([compression.pack_signs(t) for t in e[: p * c].view(p, c)])
    chunk_bounds = parts[0][1]
    scales = torch.rand(p * (len(chunk_bounds) - 1), generator=gen)
    error = torch.randn(c, generator=gen)
    for m, zero_from in ((mask[:c], c), (None, c - 2500)):
        out, want = torch.empty(c), torch.empty(c)
        out_row = torch.full((1, nb + 9), 0xCD, dtype=torch.uint8)
        norms = _cpu_kernels.decompress_sum_norms_(rows, scales, chunk_bounds, error, out, m, zero_from, out_row)
        assert _same(norms, _cpu_kernels.decompress_sum_norms_(rows, scales, chunk_bounds, error, want, m, zero_from))
        assert _same(out, want)
        assert torch.equal(out_row[0, :nb], compression._pack_signs_torch(want))
        assert bool((out_row[0, nb:] == 0xCD).all())
    before, row_bytes, in_rows = out.clone(), rows.clone(), rows[:1]  # signs over the rows, two rows, not rows
    for signs in (in_rows, torch.zeros(2, nb, dtype=torch.uint8), torch.zeros(nb, dtype=torch.uint8)):
        assert _cpu_kernels.decompress_sum_norms_(rows, scales, chunk_bounds, error, out, None, c, signs) is None
        assert _same(out, before) and torch.equal(rows, row_bytes) and (signs is in_rows or not signs.any())


def test_the_norms_fused_into_the_passes_are_torchs_bits(kernels):  # noqa: ANN001
    """y = x + e_w, the server's sum and the implied gradients with their norms from the same pass: torch's bits.

    Segments of every remainder, across the blocks the loops reduce, with and without a mask (the padding zeroed).
    """
    if not _cpu_kernels._own_norm:
        pytest.skip("this torch build reduces in another order: the fused norms are not used (checked at load)")
    lib = _cpu_kernels._library_or_none()
    x, bounds = _segments_of(_BLOCKED, 0)
    n = x.numel()
    gen = torch.Generator().manual_seed(1)
    e = torch.randn(n, generator=gen)
    mask = (torch.rand(n, generator=gen) > 0.3).to(torch.uint8)  # a layout's mask
    for m, zero_from in ((mask, n), (None, n - 3000), (None, n)):
        y = x.clone()
        norms = _cpu_kernels.add_masked_norms_(y, e, m, zero_from, bounds)
        want = (x + e) * m if m is not None else torch.cat([(x + e)[:zero_from], torch.zeros(n - zero_from)])
        assert _same(y, want)
        assert _same(norms, lib.norms(list(want.split(_BLOCKED)), 0))
        assert _same(norms, torch.stack(torch._foreach_norm(list(want.split(_BLOCKED)))))

    p, c = 3, n - n % 8
    copies = [torch.randn(c, generator=gen) for _ in range(p)]
    rows = torch.stack([_cpu_kernels.pack_signs(t) for t in copies])
    chunk_bounds = [b for b in bounds if b < c] + [c]
    scales = torch.rand(p * (len(chunk_bounds) - 1), generator=gen)
    error = torch.randn(c, generator=gen)
    for m, zero_from in ((mask[:c], c), (None, c - 2500), (None, c + 8)):
        out, want = torch.empty(c), torch.empty(c)
        norms = _cpu_kernels.decompress_sum_norms_(rows, scales, chunk_bounds, error, out, m, zero_from)
        assert _cpu_kernels.decompress_sum_(rows, scales, chunk_bounds, error, want, m)
        if m is None:
            want[zero_from:] = 0.0
        assert _same(out, want)
        sizes = [b - a for a, b in zip(chunk_bounds, chunk_bounds[1:])]
        assert _same(norms, torch.stack(torch._foreach_norm(list(want.split(sizes)))))

    values = list(x.clone().split(_BLOCKED))
    dens = [t.abs() + 0.5 for t in torch.randn(n, generator=gen).split(_BLOCKED)]
    momenta = list(torch.randn(n, generator=gen).split(_BLOCKED))
    means = torch.rand(len(values), generator=gen) + 0.5
    for implied in (momenta, None):
        fused, plain = [v.clone() for v in values], [v.clone() for v in values]
        norms = _cpu_kernels.from_update_units_norms_(fused, dens, implied, means, 10.0)
        assert _cpu_kernels.from_update_units_(plain, dens, implied, means, 10.0)
        assert all(map(_same, fused, plain))
        assert _same(norms, torch.stack(torch._foreach_norm(plain)))

    grads, ratio_dens = list(x.split(_BLOCKED)), [d * 1e-3 for d in dens]
    floors, masked = torch.full((len(grads),), 5e-4), [i % 2 == 0 for i in range(len(grads))]
    ratios = [torch.where((d < f) & flag, 0.0, g / d) for g, d, f, flag in zip(grads, ratio_dens, floors, masked)]
    assert _same(lib.masked_ratio_norms(grads, ratio_dens, floors, masked, True, 0),
                 torch.stack(torch._foreach_norm(ratios)))  # fmt: skip
    assert _same(lib.masked_ratio_norms(grads, ratio_dens, floors, masked, False, 0),
                 torch.stack(torch._foreach_norm(ratios)))  # fmt: skip

    # the messages with the lane's norms: the gradients' and their masked ratios'
    clip = [d * 0.5 for d in ratio_dens]
    for clip_dens, exp_avgs, grad_norms in ((clip, momenta, True), (None, None, False)):
        fused, plain = [torch.empty_like(g) for g in grads], [torch.empty_like(g) for g in grads]
        found = _cpu_kernels.update_unit_messages_norms_(
            grads, clip_dens, exp_avgs, ratio_dens, fused, 31.6, 0.1, means, floors, masked, grad_norms
        )  # fmt: skip
        assert _cpu_kernels.update_unit_messages_(grads, clip_dens, exp_avgs, ratio_dens, plain, 31.6, 0.1, means)
        assert all(map(_same, fused, plain))
        assert _same(found[1], torch.stack(torch._foreach_norm(ratios)))
        assert _same(found[0], torch.stack(torch._foreach_norm(grads))) if grad_norms else found[0] is None
    assert _cpu_kernels.update_unit_messages_norms_(  # the ratios read g after the message: no aliases taken
        grads, None, None, ratio_dens, grads, 31.6, 0.1, means, floors, masked, False
    ) is None  # fmt: skip


def test_a_norm_in_another_order_is_not_used_and_the_samples_stay_torchs(kernels, monkeypatch):  # noqa: ANN001
    """The check finds a library norm that sums in another order; the ratios' norms then come from torch's."""
    lib = _cpu_kernels._library_or_none()

    class OtherOrder:  # the library, with a norm summed in float64 (the right value, other bits)
        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(lib, name)

        def norms(self, ts, limit):  # noqa: ANN001, ANN202
            return torch.stack([t.double().square().sum().sqrt().float() for t in ts])

        def masked_ratio_norms(self, grads, dens, floors, masked, own, limit):  # noqa: ANN001, ANN202
            got = lib.masked_ratio_norms(grads, dens, floors, masked, False, limit)
            return self.norms([g / d for g, d in zip(grads, dens)], limit) if own else got

    monkeypatch.setattr(_cpu_kernels, "_library", OtherOrder())
    assert not _cpu_kernels_check.norm_agrees_with_torch()
    monkeypatch.setattr(_cpu_kernels, "_tried", False)
    monkeypatch.setattr(_cpu_kernels, "_library", None)
    monkeypatch.setattr(_cpu_kernels, "_load", lambda: OtherOrder())
    assert _cpu_kernels.enabled() and not _cpu_kernels._own_norm  # the other kernels stay, its norm does not
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=gen) for n in (1, 7, 33, 1000, 4099)]  # finite: every norm compared
    dens = [torch.rand(g.shape, generator=gen) + 0.1 for g in grads]
    means, counts = torch.ones(len(dens)), torch.full((len(dens),), 7.0)
    with_library = scale_samples(grads, dens, means, counts, None, 1e-8)
    assert torch.isfinite(with_library).all()
    assert _cpu_kernels.norms(grads) is None  # the norm in another order is not used
    _kernels_off(monkeypatch)
    assert _same(with_library, scale_samples(grads, dens, means, counts, None, 1e-8))


@pytest.mark.parametrize(("beta1", "decay"), [(0.9, 1.0), (0.9, 0.999), (0.3, 0.99)])
def test_the_adam_update_is_torchs_bits_and_counts_as_in_place(kernels, monkeypatch, beta1, decay):  # noqa: ANN001
    grads, roots = _lists(3)
    dens = F.denominators([r * r for r in roots], 0.3, 1e-8)
    start = [torch.randn(g.shape, generator=torch.Generator().manual_seed(i)) for i, g in enumerate(grads)]

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        params, exp_avgs = [t.clone() for t in start], [t.clone() * 0.5 for t in start]
        versions = [t._version for t in params + exp_avgs]
        F.adam_update(params, grads, exp_avgs, [], lr=1e-3, beta1=beta1, beta2=0.999, c1=0.4, decay=decay,
                      update_variance=False, make_denominators=lambda: dens)  # fmt: skip
        return params, exp_avgs, [t._version - v for t, v in zip(params + exp_avgs, versions)]

    counting = _counting(monkeypatch)
    fused = run()
    # torch's lerp takes another form from a weight of 0.5 (beta1 = 0.3): that stays with torch
    assert counting.taken.get("adam_update", 0) == (1 if beta1 > 0.5 else 0)
    _kernels_off(monkeypatch)
    plain = run()
    assert all(map(_same, fused[0], plain[0])) and all(map(_same, fused[1], plain[1]))
    assert all(bumped > 0 for bumped in fused[2])  # autograd sees the parameters written in place


def test_dividing_inside_the_update_is_dividing_first(kernels, monkeypatch):  # noqa: ANN001
    """The norm proxies' divisors applied in the update's pass: the bits of torch's division, then the update."""
    grads, roots = _lists(3, sizes=(0, 1, 7, 9, 1000, 4099))
    grads = [g.nan_to_num(0.0, 1e3, -1e3) for g in grads]
    divisors = torch.tensor([0.37, 3.0, 1.0, 1e-3, 0.5, 2.5])
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(g.shape, generator=gen) for g in grads]
    momenta = [torch.randn(g.shape, generator=gen) for g in grads]
    dens = [r + 1e-3 for r in roots]
    fused_p, fused_m = [p.clone() for p in params], [m.clone() for m in momenta]
    assert _cpu_kernels.adam_update_(fused_p, grads, fused_m, dens, 0.1, 0.999, -1e-3, divisors)
    _kernels_off(monkeypatch)
    plain_p, plain_m = [p.clone() for p in params], [m.clone() for m in momenta]
    divided = torch._foreach_div(grads, list(divisors.unbind()))
    torch._foreach_lerp_(plain_m, divided, 0.1)
    torch._foreach_mul_(plain_p, 0.999)
    torch._foreach_addcdiv_(plain_p, plain_m, dens, value=-1e-3)
    assert all(map(_same, fused_m, plain_m)) and all(map(_same, fused_p, plain_p))


def test_the_sync_arithmetic_is_torchs_bits_also_for_products_that_underflow(kernels, monkeypatch):  # noqa: ANN001
    """torch's addcmul rounds its multiply-add once: a product that underflows keeps its sign (-0)."""
    grads, roots = _lists(4)
    tiny = [g * 1e-13 for g in grads]
    dens = F.denominators([r * r for r in roots], 0.3, 1e-8)
    factors = [0.999, 1.0, 1e-30, 0.5, 1.0, 2.0, 1e-20, 1e-30]  # 1e-20, 1e-30: products that underflow
    moved = [True, True, True, False, True, True, True, True]
    outs = [t.clone() for t in tiny]
    synced, moms, params = [d * 3.0 for d in dens], [t.clone() for t in tiny], [torch.empty_like(t) for t in tiny]
    start = [s.clone() for s in synced]
    counting = _counting(monkeypatch)
    fresh = _cpu_kernels.scaled_difference(outs, dens, factors)  # into new tensors
    assert _cpu_kernels.scaled_difference_(outs, outs, dens, factors)  # outs aliasing a
    assert _cpu_kernels.apply_sync_(params, synced, tiny, moms, dens, factors[::-1], factors, moved)
    assert counting.taken == {"scaled_difference_new": 1, "scaled_difference": 1, "apply_sync": 1}
    want = [t.clone() for t in tiny]
    torch._foreach_mul_(want, factors)
    torch._foreach_sub_(want, dens)
    assert all(map(_same, outs, want)) and all(map(_same, fresh, want))
    assert all(f.shape == t.shape and f.data_ptr() != t.data_ptr() for f, t in zip(fresh, tiny))
    want_p = [s.clone() for s in start]
    torch._foreach_mul_(want_p, factors[::-1])
    torch._foreach_sub_(want_p, tiny)
    assert all(map(_same, params, want_p)) and all(map(_same, synced, want_p))
    want_m = [t.clone() for t in tiny]
    chosen = [i for i, m in enumerate(moved) if m]
    torch._foreach_zero_([want_m[i] for i in chosen])
    torch._foreach_addcmul_([want_m[i] for i in chosen], [tiny[i] for i in chosen], [dens[i] for i in chosen],
                            [factors[i] for i in chosen])  # fmt: skip
    assert all(map(_same, moms, want_m))
    underflowed = [(w == 0) & w.signbit() & (t != 0) & (d != 0) for w, t, d in zip(want_m, tiny, dens)]
    assert any(bool(u.any()) for u in underflowed)  # -0 from a product of non-zeros: the case is there


def test_what_the_kernels_do_not_take_goes_to_torch(kernels):  # noqa: ANN001
    g = torch.randn(8, 8)
    d = torch.rand(8, 8) + 0.1
    assert _cpu_kernels.clip_to_bounds([g.t()], [d], 3.0) is None  # not contiguous
    assert _cpu_kernels.clip_to_bounds([g.double()], [d.double()], 3.0) is None  # not float32
    assert _cpu_kernels.scaled_difference([g], [d.t()], [0.5]) is None  # not contiguous: nothing allocated
    assert _cpu_kernels.scaled_difference([g], [d[:4]], [0.5]) is None  # another element count
    assert _cpu_kernels.scaled_difference([g, g], [d, d], [0.5]) is None  # a factor short
    assert _cpu_kernels.all_finite([]) is None
    assert _cpu_kernels.all_finite([torch.ones(3).to_sparse()]) is None
    with torch.inference_mode():
        frozen = torch.ones(3)
    assert _cpu_kernels.all_finite([frozen]) is None
    assert not _cpu_kernels.adam_update_([g], [g], [g.clone()], [d], 0.7, 1.0, -1e-3)  # torch's other lerp form
    x, out, scales = torch.randn(16), torch.empty(16), torch.ones(2)
    assert not _cpu_kernels.compression_error_(x, scales, (0, 9, 8), out)  # bounds that decrease
    assert not _cpu_kernels.compression_error_(x, scales, (0, 8, 15), out)  # bounds short of the end
    assert not _cpu_kernels.compression_error_(x, scales, (0, 8, 16), out, torch.ones(15))  # a short mask
    assert not _cpu_kernels.compression_error_(x, scales, (0, 8, 16), x)  # out is x
    assert not _cpu_kernels.decompress_(torch.zeros(1, dtype=torch.uint8), scales, (0, 8, 16), out)  # too few signs
    rows, error = torch.zeros(2, 1, dtype=torch.uint8), torch.zeros(16)
    assert not _cpu_kernels.decompress_sum_(rows, scales.repeat(2), (0, 8, 16), error, out)  # rows too short
    assert not _cpu_kernels.decompress_sum_(rows[:0], scales[:0], (0, 8, 16), error, out)  # no rows
    assert not _cpu_kernels.decompress_sum_(rows, scales.repeat(2), (0, 8, 16), out, out)  # error is out
    big = torch.ones(_cpu_kernels._GRAIN)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # torch would split a large tensor over threads: left to it
        assert _cpu_kernels.all_finite([big]) is None and _cpu_kernels.all_finite([g]) is True
        torch.set_num_threads(1)
        assert _cpu_kernels.all_finite([big]) is True
    finally:
        torch.set_num_threads(threads)


def _phases(cls, steps: int, monkeypatch, on: bool):  # noqa: ANN001, ANN202
    """``steps`` steps of ``cls`` from defaults (every phase), kernels on or off: parameters and state."""
    if not on:
        _kernels_off(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    kw = {"freeze_step": 6} if cls is OneBitAdam else {"var_freeze_step": 6, "local_step_clipper": 4}
    opt = cls(model.parameters(), lr=3e-3, **kw)
    kinds = []
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        tokens = torch.randint(0, 20 + step, (8, 5), generator=gen)
        loss = model(tokens).pow(2).mean() * (0.9**step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        kinds.append(opt.last_step_kind)
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in model.parameters()]
    return params, state, kinds


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_a_run_is_the_same_run_with_the_kernels_and_without(kernels, monkeypatch, cls):  # noqa: ANN001
    counting = _counting(monkeypatch)
    fused = _phases(cls, 24, monkeypatch, on=True)
    used = {"all_finite", "adam_update", "clip_to_bounds", "split_denominators", "masked_ratio_norms"}
    if cls is ZeroOneAdam:  # one process: the sync's displacements into tensors the kernel allocates
        used |= {"scaled_difference_new", "apply_sync"}
    assert set(counting.taken) >= used, counting.taken  # each kernel of these phases ran
    plain = _phases(cls, 24, monkeypatch, on=False)
    assert fused[2] == plain[2]
    kinds = {k.value for k in fused[2] if k is not None}
    assert kinds >= ({"exact", "onebit_momentum"} if cls is OneBitAdam else {"exact", "local", "onebit_sync"})
    assert all(map(_same, fused[0], plain[0]))
    for a, b in zip(fused[1], plain[1]):
        assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def _hook_run(rank: int, world: int, name: str, on: bool, masked: bool = True):  # noqa: ANN202
    """A 2-rank DDP run of ``name`` with the hook, kernels on or off: parameters, state, kinds, kernels taken, own norm.

    0/1 Adam with 1-bit gradient steps between its variance steps (``exact_warmup_steps`` short).
    """
    if not on:
        os.environ["HF_ZEROONE_CPU_KERNELS"] = "0"
    from torch.nn.parallel import DistributedDataParallel

    from hf_zeroone import _cpu_kernels as kernels
    from hf_zeroone.ddp_hook import register_zeroone_hook

    counting = _Counting(kernels._library_or_none()) if on else None
    if on:
        kernels._library = counting
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    ddp = DistributedDataParallel(model)
    cls = {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam}[name]
    zeroone = {"var_freeze_step": 12, "exact_warmup_steps": 3, "var_update_scaler": 1, "local_step_clipper": 4}
    kw = {"freeze_step": 6} if cls is OneBitAdam else zeroone
    opt = cls(ddp.parameters(), lr=3e-3, auto_momentum_mask=masked, **kw)  # the embedding's unused rows masked
    register_zeroone_hook(ddp, opt)
    gen = torch.Generator().manual_seed(1 + rank)
    kinds = []
    for step in range(24):
        tokens = torch.randint(0, 20 + step, (8, 5), generator=gen)
        loss = ddp(tokens).pow(2).mean() * (0.9**step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        kinds.append(None if opt.last_step_kind is None else opt.last_step_kind.value)
    opt.comm.close()
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in model.parameters()]
    return params, state, kinds, dict(counting.taken) if on else {}, kernels._own_norm


@pytest.mark.parametrize("name, masked", [("OneBitAdam", True), ("ZeroOneAdam", True), ("OneBitAdam", False)])
def test_a_two_rank_hook_run_is_the_same_run_with_the_kernels_and_without(kernels, name, masked):  # noqa: ANN001
    """The 1-bit messages, their compression and the combined results: the same bits with and without the kernels.

    With masked rows (the caller's mask in the allreduce's passes) and without (only the padding).
    """
    fused = run_ranks(_hook_run, 2, name, True, masked, timeout=300)
    plain = run_ranks(_hook_run, 2, name, False, masked, timeout=300)
    taken = fused[0][3]
    used = {"compression_error", "decompress"}
    if name == "ZeroOneAdam":
        used |= {"apply_sync", "from_update_units"}
    if fused[0][4]:  # the library's own norm passed its check: norms (and signs) from the passes that write them
        used |= {"add_masked_norms", "decompress_sum_norms", "update_unit_messages_norms"}
        used |= {"from_update_units_norms", "norms"} if name == "OneBitAdam" else set()  # norms clipping left
        assert "pack_signs" not in taken, sorted(taken.items())  # packed inside the worker's and the server's pass
    else:
        used |= {"update_unit_messages", "decompress_sum", "from_update_units", "pack_signs"}
        used |= {"add_masked"} if masked else set()
    assert set(taken) >= used, sorted(taken.items())  # each kernel of the 1-bit path ran
    kinds = set(fused[0][2])
    assert kinds >= ({"onebit_momentum"} if name == "OneBitAdam" else {"onebit_gradient", "local", "onebit_sync"})
    for rank in range(2):
        assert fused[rank][2] == plain[rank][2]
        assert all(map(_same, fused[rank][0], plain[rank][0]))
        for a, b in zip(fused[rank][1], plain[rank][1]):
            assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def test_other_threads_wait_for_the_load_time_check(kernels, monkeypatch):  # noqa: ANN001
    """The communicator's thread runs kernels too: it never gets a library that is still being checked."""
    lib = _cpu_kernels._library_or_none()
    started, release = threading.Event(), threading.Event()

    def slow_refusal() -> bool:
        started.set()
        release.wait(30)
        return False

    monkeypatch.setattr(_cpu_kernels, "_tried", False)
    monkeypatch.setattr(_cpu_kernels, "_library", None)
    monkeypatch.setattr(_cpu_kernels, "_load", lambda: lib)
    monkeypatch.setattr(_cpu_kernels, "_agrees_with_torch", slow_refusal)

    def first() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _cpu_kernels._library_or_none()

    loading = threading.Thread(target=first)
    loading.start()
    assert started.wait(30)
    seen: list = []
    other = threading.Thread(target=lambda: seen.append(_cpu_kernels._library_or_none()))
    other.start()
    other.join(0.5)
    waited = other.is_alive()
    release.set()
    loading.join(30)
    other.join(30)
    assert waited and seen == [None]  # it waited, then got the refusal, never the unchecked library


def test_the_load_time_check_passes_whatever_torchs_default_dtype(kernels):  # noqa: ANN001
    """The check builds CPU float32 values itself: a user's ``set_default_dtype`` does not turn the kernels off."""
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert _cpu_kernels._agrees_with_torch()
    finally:
        torch.set_default_dtype(default)


def test_a_library_built_with_other_rounding_is_refused(monkeypatch, tmp_path):  # noqa: ANN001
    """Contracted multiply-adds round once where torch rounds twice: the check at load finds it."""
    monkeypatch.setenv("HF_ZEROONE_CACHE", str(tmp_path))
    monkeypatch.setattr(_cpu_kernels, "_FLAGS", tuple(f.replace("off", "fast") for f in _cpu_kernels._FLAGS))
    monkeypatch.setattr(_cpu_kernels, "_tried", False)
    monkeypatch.setattr(_cpu_kernels, "_library", None)
    lib = _cpu_kernels._load()  # a build of its own (about 30 s)
    if lib is None:
        pytest.skip("the compiler built nothing with these flags")
    scales = torch.tensor([1.1], dtype=torch.float32)
    # with contraction x * s + eps is one rounding: some x differ (when the CPU has FMA at all)
    monkeypatch.setattr(_cpu_kernels, "_library", lib)
    monkeypatch.setattr(_cpu_kernels, "_tried", True)
    monkeypatch.setattr(_cpu_kernels, "_own_norm", False)  # not checked for this build
    x = torch.rand(10000, generator=torch.Generator().manual_seed(0))
    roots = [x.clone()]
    _cpu_kernels.scaled_denominators_(roots, scales, 1e-3)
    if _same(roots[0], x * scales[0] + torch.tensor(1e-3)):
        pytest.skip("no fused multiply-add on this CPU: nothing for the check to find")
    assert not _cpu_kernels._agrees_with_torch()
    monkeypatch.setattr(_cpu_kernels, "_tried", False)
    monkeypatch.setattr(_cpu_kernels, "_library", None)
    monkeypatch.setattr(_cpu_kernels, "_load", lambda: lib)
    with pytest.warns(RuntimeWarning, match="do not give torch's bits"):
        assert not _cpu_kernels.enabled()
    assert F.clip_to_variance([torch.ones(3)], [torch.ones(3)], 0.999)[0].tolist() == [1.0, 1.0, 1.0]


def test_without_a_compiler_a_warning_and_torchs_operations(monkeypatch, tmp_path):  # noqa: ANN001
    monkeypatch.setenv("HF_ZEROONE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(_cpu_kernels, "_tried", False)
    monkeypatch.setattr(_cpu_kernels, "_library", None)
    with pytest.warns(RuntimeWarning, match=r"no C\+\+ compiler .*set HF_ZEROONE_CPU_KERNELS=0"):
        assert not _cpu_kernels.enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert not _cpu_kernels.enabled()
    d = F.denominators([torch.full((3,), 4.0)], 1.0, 0.5)
    assert d[0].tolist() == [2.5, 2.5, 2.5] and not list(tmp_path.iterdir())


def test_the_switch_turns_them_off_without_a_word(monkeypatch):  # noqa: ANN001
    monkeypatch.setenv("HF_ZEROONE_CPU_KERNELS", "0")
    monkeypatch.setattr(_cpu_kernels, "_tried", False)
    monkeypatch.setattr(_cpu_kernels, "_library", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _cpu_kernels.enabled()
    assert math.isclose(F.denominators([torch.full((2,), 9.0)], 1.0, 0.0)[0][0].item(), 3.0)


def test_two_installations_of_the_same_sources_share_one_build(kernels, tmp_path):  # noqa: ANN001
    """torch rebuilds an extension whose source path changed: two checkouts used to rebuild each other's."""
    folder = _cpu_kernels._cache_dir() / _cpu_kernels._build_name()
    built = {p: p.stat().st_mtime_ns for p in folder.glob("*.so")}
    assert built
    package = Path(_cpu_kernels.__file__).parent
    shutil.copytree(package, tmp_path / "hf_zeroone", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_ZEROONE_CACHE": str(_cpu_kernels._cache_dir())}
    code = "import hf_zeroone, hf_zeroone._cpu_kernels as k; print(hf_zeroone.__file__, k.enabled())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert out.stdout.split() == [str(tmp_path / "hf_zeroone" / "__init__.py"), "True"], out.stderr
    assert {p: p.stat().st_mtime_ns for p in folder.glob("*.so")} == built  # loaded, not built again


def test_a_build_killed_midway_does_not_stop_the_next_process(kernels, tmp_path):  # noqa: ANN001
    """torch's lock file outlives a process killed while building: the next one used to wait for it forever."""
    folder = _cpu_kernels._cache_dir() / _cpu_kernels._build_name()
    (folder / "lock").write_text("")  # what a killed build leaves
    code = "import hf_zeroone._cpu_kernels as k; print(k.enabled())"
    env = {**os.environ, "HF_ZEROONE_CACHE": str(_cpu_kernels._cache_dir())}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True"], out.stderr
    assert not (folder / "lock").exists()
