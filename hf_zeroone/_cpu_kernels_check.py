"""The load-time check of the fused CPU kernels (:mod:`hf_zeroone._cpu_kernels`): torch's bits, or not used.

Each kernel runs on values of every float32 class (zeros of both signs, subnormals, the largest,
infinities, NaN, products that underflow) and on sizes with and without a vector's remainder,
against the torch operations it stands for. A library that a compiler built with other rounding
(contracted multiply-adds, fast maths) fails here and is not used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hf_zeroone import _cpu_kernels as K

__all__ = ["agrees_with_torch", "norm_agrees_with_torch", "same"]

#: whatever torch's defaults are (``set_default_dtype``, ``set_default_device``): the kernels take CPU float32
F32 = {"dtype": torch.float32, "device": "cpu"}


def same(a: Tensor, b: Tensor) -> bool:
    """The same bits, NaN for NaN (whatever its payload)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def agrees_with_torch() -> bool:
    """Each kernel against the torch operations it stands for, on values with every float32 class in them."""
    gen = torch.Generator().manual_seed(0)
    f32 = {"dtype": torch.float32, "device": "cpu"}  # whatever torch's defaults are
    sizes = (1, 7, 33, 1000)
    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3e38, float("inf"), -1.0, 1.0], **f32)
    tiny = [torch.randn(n, generator=gen, **f32) * 1e-13 for n in sizes]  # products that underflow to ±0
    grads = [torch.cat([t, torch.randn(n, generator=gen, **f32), specials]) for t, n in zip(tiny, sizes)]
    roots = [torch.cat([torch.rand(2 * n, generator=gen, **f32) * 1e-3, specials.abs()]) for n in sizes]
    root_c2, eps, bound = 0.3, 1e-8, 31.62
    scales = torch.rand(len(sizes), generator=gen, **f32) + 0.5
    t32 = lambda x: torch.tensor(x, **f32)  # noqa: E731 - torch's 0-dim operand
    try:
        split = [r.clone() for r in roots]
        plain = K.split_denominators_(split, root_c2, scales, eps)
        in_place, scaled = [r.clone() for r in roots], [r.clone() for r in roots]
        K.plain_denominators_(in_place, root_c2, eps)
        K.scaled_denominators_(scaled, scales, eps)
        want_plain = [r / t32(root_c2) + t32(eps) for r in roots]
        ok = all(map(same, plain, want_plain)) and all(map(same, in_place, want_plain))
        want_scaled = [x * s + t32(eps) for x, s in zip(roots, scales.unbind())]
        ok &= all(map(same, split, want_scaled)) and all(map(same, scaled, want_scaled))
        clipped = K.clip_to_bounds(grads, want_plain, bound)
        bounds = [d * t32(bound) for d in want_plain]
        want = [torch.maximum(torch.minimum(g, b), -b) for g, b in zip(grads, bounds)]
        ok &= all(map(same, clipped, want))
        floors = torch.full((len(sizes),), 2e-4, **f32)
        shaped = [g[: (g.numel() // 4) * 4].reshape(-1, 4) for g in grads]  # 2-D tensors: the norm's order
        shaped_dens = [d[: (d.numel() // 4) * 4].reshape(-1, 4) for d in want_plain]
        norms = K.masked_ratio_norms(shaped, shaped_dens, floors, [True, False, True, False])
        want = [g / d for g, d in zip(shaped, shaped_dens)]
        for i in (0, 2):
            want[i].masked_fill_(shaped_dens[i] < floors[i], 0.0)
        ok &= same(norms, torch.stack(torch._foreach_norm(want)))
        for decay in (1.0, 0.99):
            ps, ms = [g.clone() for g in grads], [d.clone() for d in want_plain]
            K.adam_update_(ps, want_scaled, ms, want_plain, 0.1, decay, -3e-3)
            want_p, want_m = [g.clone() for g in grads], [d.clone() for d in want_plain]
            torch._foreach_lerp_(want_m, want_scaled, 0.1)
            if decay != 1.0:
                torch._foreach_mul_(want_p, t32(decay))
            torch._foreach_addcdiv_(want_p, want_m, want_plain, value=-3e-3)
            ok &= all(map(same, ps, want_p)) and all(map(same, ms, want_m))
        factors = [0.999, 1.0, 1e-30, 0.5]  # 1e-30: products that underflow, to zeros of both signs
        fresh = K.scaled_difference(want_plain, grads, factors)
        out = [g.clone() for g in grads]
        K.scaled_difference_(out, want_plain, out, factors)
        want = [g.clone() for g in grads]
        copies = [d.clone() for d in want_plain]
        torch._foreach_mul_(copies, factors)
        torch._foreach_sub_(copies, want)
        ok &= all(map(same, out, copies)) and all(map(same, fresh, copies))
        ok &= _sync_agrees(grads, want_plain, factors)
        ok &= _messages_agree(grads, want_plain, want_scaled, bound, scales)
        ok &= _compression_agrees(gen)
        ok &= K.all_finite([torch.ones(40, **f32)]) and not K.all_finite(grads)
        ok &= not K.all_finite([torch.tensor([float("nan")], **f32)])
        return bool(ok)
    except Exception:  # noqa: BLE001 - a broken library is not used
        return False


def norm_agrees_with_torch() -> bool:
    """The library's own 2-norm (``hz_norm2``) against ``torch._foreach_norm``, on every remainder of its order.

    The order of torch's float32 reduction is its build's (vector width, how the compiler treated the
    remainder loop), not a documented contract. Tried: sizes 0 to 80 (every remainder of its eight
    lanes and fours, with and without full lanes) and larger ones, two draws each (one at a moderate
    scale, one from 1e-20 to 1e20, so sums round at every magnitude and squares underflow and
    overflow), single elements of every float32 class, and the classes (subnormals, the largest,
    infinities, NaN) in a lane, in the remainder's fours and in its fused tail. Sizes above torch's
    threading grain only in a process of one thread, where the library takes them (with more
    threads torch splits those and they stay with torch). A miss leaves torch's norm in use.
    """
    try:
        gen = torch.Generator().manual_seed(1)
        sizes = [*range(81), 255, 1001, 4103, 20011]
        if torch.get_num_threads() == 1:
            sizes += [40009, 300007]
        extremes = torch.logspace(-20, 20, len(sizes), **F32)[torch.randperm(len(sizes), generator=gen)]
        moderate = 10.0 ** (torch.rand(len(sizes), generator=gen, **F32) * 6 - 3)
        tensors = [torch.randn(n, generator=gen, **F32) * s for n, s in zip(sizes * 2, [*moderate, *extremes])]
        specials = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3e38, float("inf"), -1.0, 1.0, float("nan")], **F32)
        tensors += [specials[k : k + 1] for k in range(10)]  # one element: its magnitude, no square taken
        for before in (0, 9, 12, 13):  # in a lane, the fused tail, the fours, the fused tail after the fours
            tensors += [torch.cat([torch.randn(before, generator=gen, **F32), specials[k : k + 1]]) for k in range(10)]
        lib = K._library_or_none()
        if lib is None or not same(lib.norms(tensors, 0), torch.stack(torch._foreach_norm(tensors))):
            return False
        grads = [t.reshape(-1, 4) for t in tensors if t.numel() % 4 == 0 and t.numel()]  # 2-D: the torch form's shapes
        dens = [torch.rand(g.shape, generator=gen, **F32) + 0.5 for g in grads]
        floors = torch.full((len(grads),), 0.9, **F32)
        masked = [i % 2 == 0 for i in range(len(grads))]
        got = lib.masked_ratio_norms(grads, dens, floors, masked, True, 0)
        want = [g / d for g, d in zip(grads, dens)]
        for i in range(0, len(want), 2):
            want[i].masked_fill_(dens[i] < floors[i], 0.0)
        return same(got, torch.stack(torch._foreach_norm(want)))
    except Exception:  # noqa: BLE001 - a library whose norm fails is not used for norms
        return False


def _messages_agree(grads: list[Tensor], dens: list[Tensor], moms: list[Tensor], bound: float, means: Tensor) -> bool:
    """:func:`update_unit_messages_` and :func:`from_update_units_` against torch's operations."""
    ok = True
    # the weight 0.7: torch's lerp from the end (beta1 <= 0.5)
    for clip, momentum, weight in ((True, True, 0.1), (False, False, 0.1), (True, False, 0.1), (False, True, 0.7)):
        outs = [torch.empty_like(g) for g in grads]
        K.update_unit_messages_(
            grads, dens if clip else None, moms if momentum else None, dens, outs, bound, weight, means
        )
        want = [g.clone() for g in grads]
        if clip:
            limits = [d * torch.tensor(bound, **F32) for d in dens]
            want = [torch.maximum(torch.minimum(g, b), -b) for g, b in zip(want, limits)]
        if momentum:
            want = [torch.lerp(m, g, weight) for m, g in zip(moms, want)]
        torch._foreach_mul_(want, list(means.unbind()))
        torch._foreach_div_(want, dens)
        ok &= all(map(same, outs, want))
        values = [g.clone() for g in grads]
        K.from_update_units_(values, dens, moms if momentum else None, means, 10.0)
        want = [g.clone() for g in grads]
        torch._foreach_mul_(want, dens)
        torch._foreach_div_(want, list(means.unbind()))
        if momentum:
            want = [torch.lerp(m, v, 10.0) for m, v in zip(moms, want)]
        ok &= all(map(same, values, want))
    return bool(ok)


def _compression_agrees(gen: torch.Generator) -> bool:
    """The sign packing, compression error and decompressions against :mod:`hf_zeroone.compression`'s torch forms.

    Each with and without a uint8 mask of zeros and ones, which torch multiplies in (``-x * 0`` is ``-0``).
    """
    from hf_zeroone import compression  # the module that calls these kernels: imported here, after loading

    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-45, float("inf"), float("-inf"), float("nan"), -1.0], **F32)
    x = torch.cat([torch.randn(88, generator=gen, **F32), specials])  # 96 elements: 12 bytes of signs
    bounds, scales = (0, 5, 5, 40, 96), torch.tensor([0.5, 2.0, float("nan"), 1e-30], **F32)
    ok = torch.equal(K.pack_signs(x.view(2, 48)), compression._pack_signs_torch(x.view(2, 48)))
    mask = (torch.rand(96, generator=gen, **F32) < 0.7).to(torch.uint8)  # a layout's mask
    packed = compression._pack_signs_torch(x)
    signs = compression._unpack_signs_elementwise(packed, torch.float32).reshape(-1)
    for m in (None, mask):
        out = torch.empty_like(x)
        K.compression_error_(x, scales, bounds, out, m)
        want = x - torch.cat([torch.copysign(s, x[a:b]) for s, a, b in zip(scales, bounds, bounds[1:])])
        ok &= same(out, want if m is None else want * m)
        K.decompress_(packed, scales, bounds, out, m)
        want = torch.cat([signs[a:b] * s for s, a, b in zip(scales, bounds, bounds[1:])])
        ok &= same(out, want if m is None else want * m)
    rows = torch.randint(0, 256, (3, 7), dtype=torch.uint8, device="cpu", generator=gen)  # 3 x 48 signs, a spare byte
    chunk_bounds, row_scales = (0, 17, 17, 48), torch.rand(9, generator=gen, **F32)
    error = torch.randn(48, generator=gen, **F32)
    copies = []
    for r in range(3):
        signs = compression._unpack_signs_elementwise(rows[r, :6].contiguous(), torch.float32).reshape(-1)
        spans = zip(row_scales[3 * r :], chunk_bounds, chunk_bounds[1:])
        copies.append(torch.cat([signs[a:b] * s for s, a, b in spans]))
    want = copies[0] + error
    for c in copies[1:]:
        want += c
    for m in (None, mask[:48]):
        sums = torch.empty(48, **F32)
        K.decompress_sum_(rows, row_scales, chunk_bounds, error, sums, m)
        ok &= same(sums, want if m is None else want * m)
    y = x.clone()
    K.add_masked_(y, want.repeat(2), mask)
    ok &= same(y, (x + want.repeat(2)) * mask)
    return bool(ok)


def _sync_agrees(us: list[Tensor], dens: list[Tensor], factors: list[float]) -> bool:
    """:func:`apply_sync_` against ``_local_phase.apply_sync``'s torch operations.

    One tensor not moved; ``factors`` of 1e-30 make products that underflow, to zeros of both signs.
    """
    moved, decays = [True, False, True, True], factors[::-1]
    params, synced = [torch.empty_like(u) for u in us], [d * 3.0 for d in dens]
    moms = [d.clone() for d in dens]
    start = [s.clone() for s in synced]
    K.apply_sync_(params, synced, us, moms, dens, decays, factors, moved)
    want_p = [s.clone() for s in start]
    torch._foreach_mul_(want_p, decays)
    torch._foreach_sub_(want_p, us)
    want_m = [d.clone() for d in dens]
    for i in (0, 2, 3):
        want_m[i].zero_().addcmul_(us[i], dens[i], value=factors[i])
    ok = all(map(same, params, want_p)) and all(map(same, synced, want_p))
    return bool(ok and all(map(same, moms, want_m)))
