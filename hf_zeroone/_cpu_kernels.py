"""Fused element-wise loops for the CPU step, compiled from C at first use: torch's own results, bit for bit.

On the CPU a compressed step walks the model's tensors many times: torch runs a multi-tensor
operation as one operator per tensor, each a pass over its elements, several writing fresh
tensors. A few of those chains (the denominators of a frozen variance, clipping to the variance,
the masked ratios of ``follow_gradient_scale``'s samples) are one loop each in ``_cpu_kernels.c``,
over every tensor of a list in one call. They use only operations that torch's CPU kernels round
exactly (division, multiplication, addition, comparisons), in torch's order and compiled without
fused multiply-adds, so each gives the same bits as the torch operations it replaces: a run with
and without them is the same run, and a rank that cannot build them still agrees bit for bit with
ranks that can.

The library is built once per machine with the system's C compiler (``$CC``, else ``cc``) into
``$HF_ZEROONE_CACHE`` (default ``~/.cache/hf_zeroone``), named by a hash of the source, the flags,
the compiler and the CPU's features, and checked against torch on a small sample before its first
use in a process. Without a compiler, or when the check fails, a warning says so once and torch's
operations run instead. ``HF_ZEROONE_CPU_KERNELS=0`` turns the kernels off.

Callers offer a list; each function here returns ``None`` where it does not take it (not all
float32 contiguous CPU tensors, the kernels off, or large tensors while torch runs several threads,
which torch would split over cores and one loop here would not), and the caller runs torch's form.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "adam_update_",
    "all_finite",
    "scaled_difference_",
    "scaled_product_",
    "clip_to_bounds",
    "enabled",
    "masked_ratios",
    "plain_denominators_",
    "scaled_denominators_",
    "split_denominators_",
]

_SOURCE = Path(__file__).with_name("_cpu_kernels.c")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c99")
#: torch splits an element-wise operation over threads only above this many elements (at::internal::GRAIN_SIZE)
_GRAIN = 32768
_ENV = "HF_ZEROONE_CPU_KERNELS"

_library: ctypes.CDLL | None = None
_tried = False


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("HF_ZEROONE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hf_zeroone"
    )
    return Path(root)


def _build(compiler: str) -> Path:
    """Compile the library if this machine has no copy yet; its path."""
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join(s.encode() if isinstance(s, str) else s for s in (
        source, " ".join(_FLAGS), version, platform.machine(), _cpu_features()
    ))).hexdigest()[:16]  # fmt: skip
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "hf_zeroone"):
        target = folder / f"cpu_kernels-{key}{suffix}"
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, scratch = tempfile.mkstemp(suffix=suffix, dir=folder)
            os.close(fd)
        except OSError:
            continue  # not writable: the next folder
        try:
            command = [compiler, *_FLAGS, str(_SOURCE), "-o", scratch]
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
            os.replace(scratch, target)  # atomic: ranks building at once each finish a whole file
        finally:
            if os.path.exists(scratch):
                os.unlink(scratch)
        return target
    raise OSError(f"no writable folder for the compiled kernels (tried {_cache_dir()}; set HF_ZEROONE_CACHE)")


def _load() -> ctypes.CDLL | None:
    if os.environ.get(_ENV, "1") == "0" or sys.platform == "win32":
        return None
    compiler = os.environ.get("CC") or "cc"
    fix = f"install a C compiler (or set CC), or set {_ENV}=0 to run without them and silence this"
    if shutil.which(compiler) is None:
        warnings.warn(
            f"hf_zeroone: no C compiler ({compiler!r}) to build its fused CPU kernels; the optimizers' CPU steps "
            f"run torch's operations instead (the same results, about 1.5x slower): {fix}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(
            f"hf_zeroone: building its fused CPU kernels failed ({str(detail).strip()[:500]}); the optimizers' "
            f"CPU steps run torch's operations instead: {fix}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.hz_split_denominators.argtypes = [i64, ptr, ptr, ptr, f32, ptr, f32]
    lib.hz_plain_denominators.argtypes = [i64, ptr, ptr, f32, f32]
    lib.hz_all_finite.argtypes = [i64, ptr, ptr]
    lib.hz_all_finite.restype = ctypes.c_int
    lib.hz_scaled_denominators.argtypes = [i64, ptr, ptr, ptr, f32]
    lib.hz_adam_update.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, f32, ctypes.c_int, f32, f32]
    lib.hz_scaled_difference.argtypes = [i64, ptr, ptr, ptr, ptr, ptr]
    lib.hz_scaled_product.argtypes = [i64, ptr, ptr, ptr, ptr, ptr]
    lib.hz_clip_to_bounds.argtypes = [i64, ptr, ptr, ptr, ptr, f32]
    lib.hz_masked_ratios.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, ptr]
    for fn in (
        lib.hz_split_denominators,
        lib.hz_plain_denominators,
        lib.hz_scaled_denominators,
        lib.hz_clip_to_bounds,
        lib.hz_masked_ratios,
    ):
        fn.restype = None
    return lib


def _library_or_none() -> ctypes.CDLL | None:
    global _library, _tried
    if not _tried:
        _tried = True
        _library = _load()
        if _library is not None and not _agrees_with_torch(_library):
            warnings.warn(
                "hf_zeroone: its fused CPU kernels, as this machine's C compiler built them, do not give torch's "
                f"bits; the optimizers' CPU steps run torch's operations instead (set {_ENV}=0 to silence this)",
                RuntimeWarning,
                stacklevel=3,
            )
            _library = None
    return _library


def enabled() -> bool:
    """Whether the kernels are built, checked and on in this process (builds them on the first call)."""
    return _library_or_none() is not None


def _takes(*lists: Sequence[Tensor]) -> bool:
    first = lists[0]
    if not first or not first[0].is_cpu:
        return False
    limit = _GRAIN if torch.get_num_threads() > 1 else None
    f32 = torch.float32
    for ts in lists:
        for t in ts:  # dtypes are singletons; is_cpu reads a flag (device.type builds an object)
            if t.dtype is not f32 or not t.is_cpu or not t.is_contiguous():
                return False
            if limit is not None and t.numel() >= limit:
                return False
    return _library_or_none() is not None


def _pointers(tensors: Sequence[Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def _counts(tensors: Sequence[Tensor], *partners: Sequence[Tensor]) -> ctypes.Array | None:
    """The element counts of ``tensors``; ``None`` where a partner (same index) has another count."""
    counts = [t.numel() for t in tensors]
    if any([t.numel() for t in other] != counts for other in partners):
        return None
    return (ctypes.c_int64 * len(counts))(*counts)


def all_finite(tensors: Sequence[Tensor]) -> bool | None:
    """Whether no element of any tensor is NaN or infinite (exact: read from the exponent bits)."""
    tensors = list(tensors)
    if not _takes(tensors):
        return None
    return bool(_library_or_none().hz_all_finite(len(tensors), _pointers(tensors), _counts(tensors)))


def split_denominators_(roots: Sequence[Tensor], root_c2: float, scales: Tensor, eps: float) -> list[Tensor] | None:
    """From fresh ``roots = sqrt(v)``: new ``roots / root_c2 + eps``; ``roots`` become ``roots * scales[i] + eps``.

    ``scales``: one float32 per tensor. The scalars round to float32 as torch's 0-dim operands do.
    """
    roots = list(roots)
    if not _takes(roots) or scales.dtype != torch.float32 or scales.numel() != len(roots):
        return None
    scales = scales.contiguous().cpu()
    plain = [torch.empty_like(r) for r in roots]
    _library_or_none().hz_split_denominators(
        len(roots), _pointers(roots), _pointers(plain), _counts(roots), root_c2, scales.data_ptr(), eps
    )
    return plain


def plain_denominators_(roots: Sequence[Tensor], root_c2: float, eps: float) -> bool:
    """``roots = roots / root_c2 + eps`` in place (fresh ``roots``); ``False`` where the kernels do not take them."""
    roots = list(roots)
    if not _takes(roots):
        return False
    _library_or_none().hz_plain_denominators(len(roots), _pointers(roots), _counts(roots), root_c2, eps)
    return True


def scaled_denominators_(roots: Sequence[Tensor], scales: Tensor, eps: float) -> bool:
    """``roots = roots * scales[i] + eps`` in place (fresh ``roots``); ``False`` where the kernels do not take them."""
    roots = list(roots)
    if not _takes(roots) or scales.dtype != torch.float32 or scales.numel() != len(roots):
        return False
    scales = scales.contiguous().cpu()
    _library_or_none().hz_scaled_denominators(len(roots), _pointers(roots), _counts(roots), scales.data_ptr(), eps)
    return True


def clip_to_bounds(grads: Sequence[Tensor], dens: Sequence[Tensor], bound: float) -> list[Tensor] | None:
    """New ``maximum(minimum(g, d * bound), -(d * bound))`` for each pair (``torch.minimum``'s NaN rule)."""
    grads, dens = list(grads), list(dens)
    counts = _counts(grads, dens) if _takes(grads, dens) else None
    if counts is None:
        return None
    out = [torch.empty_like(g) for g in grads]
    _library_or_none().hz_clip_to_bounds(len(grads), _pointers(grads), _pointers(dens), _pointers(out), counts, bound)
    return out


def masked_ratios(
    grads: Sequence[Tensor], dens: Sequence[Tensor], floors: Tensor, masked: Sequence[bool]
) -> list[Tensor] | None:
    """New ``g / d`` for each pair, 0 where ``d < floors[i]`` in the tensors that ``masked`` names."""
    grads, dens = list(grads), list(dens)
    counts = _counts(grads, dens) if _takes(grads, dens) and floors.dtype == torch.float32 else None
    if counts is None or floors.numel() != len(grads):
        return None
    floors = floors.contiguous().cpu()
    flags = (ctypes.c_uint8 * len(grads))(*[1 if m else 0 for m in masked])
    out = [torch.empty_like(g) for g in grads]
    _library_or_none().hz_masked_ratios(
        len(grads), _pointers(grads), _pointers(dens), _pointers(out), counts, floors.data_ptr(), flags
    )
    return out


def _same(a: Tensor, b: Tensor) -> bool:
    """The same bits, NaN for NaN (whatever its payload)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def adam_update_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    dens: Sequence[Tensor],
    weight: float,
    decay: float,
    value: float,
) -> bool:
    """In place: ``m.lerp_(g, weight)``, ``p *= decay`` (unless 1), ``p.addcdiv_(m, d, value=value)``, in one pass.

    ``False`` (nothing written) where the kernels do not take the lists, or ``weight`` is not below
    0.5 (torch's lerp takes another form there). Bumps the version counters of ``params`` and
    ``exp_avgs``, as torch's in-place operations do.
    """
    params, grads, exp_avgs, dens = list(params), list(grads), list(exp_avgs), list(dens)
    if not abs(weight) < 0.5 or not _takes(params, grads, exp_avgs, dens):
        return False
    counts = _counts(params, grads, exp_avgs, dens)
    if counts is None:
        return False
    _library_or_none().hz_adam_update(
        len(params), _pointers(params), _pointers(grads), _pointers(exp_avgs), _pointers(dens), counts,
        weight, int(decay != 1.0), decay, value,
    )  # fmt: skip
    torch.autograd.graph.increment_version(params + exp_avgs)
    return True


def _floats(values: Sequence[float]) -> ctypes.Array:
    return (ctypes.c_float * len(values))(*values)  # each rounded to float32, as torch's scalar operands are


def scaled_difference_(
    outs: Sequence[Tensor], a: Sequence[Tensor], b: Sequence[Tensor], factors: Sequence[float]
) -> bool:
    """``out = a * factor - b`` per triple, into ``outs`` (torch's copy, ``_foreach_mul_`` and ``_foreach_sub_``).

    ``outs`` may be ``b`` itself (each element is read before it is written). Bumps the version
    counters of ``outs``. ``False`` (nothing written) where the kernels do not take the lists.
    """
    outs, a, b = list(outs), list(a), list(b)
    counts = _counts(outs, a, b) if _takes(outs, a, b) else None
    if counts is None:
        return False
    _library_or_none().hz_scaled_difference(
        len(outs), _pointers(outs), _pointers(a), _pointers(b), counts, _floats(factors)
    )
    torch.autograd.graph.increment_version(outs)
    return True


def scaled_product_(outs: Sequence[Tensor], a: Sequence[Tensor], b: Sequence[Tensor], scales: Sequence[float]) -> bool:
    """``out = scale * a * b`` per triple, into ``outs`` (torch's ``_foreach_zero_`` then ``_foreach_addcmul_``)."""
    outs, a, b = list(outs), list(a), list(b)
    counts = _counts(outs, a, b) if _takes(outs, a, b) else None
    if counts is None:
        return False
    _library_or_none().hz_scaled_product(
        len(outs), _pointers(outs), _pointers(a), _pointers(b), counts, _floats(scales)
    )
    torch.autograd.graph.increment_version(outs)
    return True


def _agrees_with_torch(lib: ctypes.CDLL) -> bool:
    """Each kernel against the torch operations it stands for, on values with every float32 class in them."""
    gen = torch.Generator().manual_seed(0)
    sizes = (1, 7, 33, 1000)
    specials = torch.tensor([0.0, -0.0, 1e-45, 1e-38, 3e38, float("inf"), -1.0, 1.0])
    grads = [torch.cat([torch.randn(n, generator=gen), specials]) for n in sizes]
    roots = [torch.cat([torch.rand(n, generator=gen) * 1e-3, specials.abs()]) for n in sizes]
    root_c2, eps, bound = 0.3, 1e-8, 31.62
    scales = torch.rand(len(sizes), generator=gen) + 0.5
    t32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731 - torch's 0-dim operand
    try:
        split = [r.clone() for r in roots]
        plain = split_denominators_(split, root_c2, scales, eps)
        in_place, scaled = [r.clone() for r in roots], [r.clone() for r in roots]
        plain_denominators_(in_place, root_c2, eps)
        scaled_denominators_(scaled, scales, eps)
        want_plain = [r / t32(root_c2) + t32(eps) for r in roots]
        ok = all(map(_same, plain, want_plain)) and all(map(_same, in_place, want_plain))
        want_scaled = [x * s + t32(eps) for x, s in zip(roots, scales.unbind())]
        ok &= all(map(_same, split, want_scaled)) and all(map(_same, scaled, want_scaled))
        clipped = clip_to_bounds(grads, want_plain, bound)
        bounds = [d * t32(bound) for d in want_plain]
        want = [torch.maximum(torch.minimum(g, b), -b) for g, b in zip(grads, bounds)]
        ok &= all(map(_same, clipped, want))
        floors = torch.full((len(sizes),), 2e-4)
        ratios = masked_ratios(grads, want_plain, floors, [True, False, True, False])
        want = [g / d for g, d in zip(grads, want_plain)]
        for i in (0, 2):
            want[i].masked_fill_(want_plain[i] < floors[i], 0.0)
        ok &= all(map(_same, ratios, want))
        for decay in (1.0, 0.99):
            ps, ms = [g.clone() for g in grads], [d.clone() for d in want_plain]
            adam_update_(ps, want_scaled, ms, want_plain, 0.1, decay, -3e-3)
            want_p, want_m = [g.clone() for g in grads], [d.clone() for d in want_plain]
            torch._foreach_lerp_(want_m, want_scaled, 0.1)
            if decay != 1.0:
                torch._foreach_mul_(want_p, t32(decay))
            torch._foreach_addcdiv_(want_p, want_m, want_plain, value=-3e-3)
            ok &= all(map(_same, ps, want_p)) and all(map(_same, ms, want_m))
        factors = [0.999, 1.0, 1e-3, 0.5]
        out = [g.clone() for g in grads]
        scaled_difference_(out, want_plain, out, factors)
        want = [g.clone() for g in grads]
        copies = [d.clone() for d in want_plain]
        torch._foreach_mul_(copies, factors)
        torch._foreach_sub_(copies, want)
        ok &= all(map(_same, out, copies))
        scaled_product_(out, grads, want_plain, factors)
        torch._foreach_zero_(want)
        torch._foreach_addcmul_(want, grads, want_plain, factors)
        ok &= all(map(_same, out, want))
        ok &= all_finite([torch.ones(40)]) and not all_finite(grads) and not all_finite([torch.tensor([float("nan")])])
        return bool(ok)
    except Exception:  # noqa: BLE001 - a broken library is not used
        return False
