"""Fused element-wise loops for the CPU step, compiled at first use: torch's own results, bit for bit.

On the CPU a compressed step walks the model's tensors many times: torch runs a multi-tensor
operation as one operator per tensor, each a pass over its elements, several writing fresh
tensors. Several of those chains are one loop each in ``_cpu_kernels.c``, over every tensor of a
list in one call: the denominators of a frozen variance, clipping to the variance, the masked
ratios of ``follow_gradient_scale``'s samples and per-tensor 2-norms (in torch's order, where a
second load-time check finds that order), the finiteness check, Adam's momentum-and-parameter
update, 0/1 Adam's sync; the 1-bit messages in update units (clipped, as momenta) and the
combined results out of them (as implied gradients); and the two-stage allreduce's arithmetic
(sign packing, compression error, decompression, the server's sum, each with the caller's mask).
They use only operations that torch's CPU kernels round exactly (division, multiplication,
addition, comparisons, a norm's scalar square root; ``fmaf`` where torch fuses), in torch's order and compiled without
contraction into fused multiply-adds, so each gives the same bits as the torch operations it replaces: a run with
and without them is the same run, and a rank that cannot build them still agrees bit for bit with
ranks that can.

The loops are bound to torch in ``_cpu_kernels.cpp`` (lists of tensors in, checked and walked in
C++: one call per list, no Python loop over its tensors), built once per machine as a torch C++
extension with the system's C++ compiler (``$CXX``, else ``c++``) and ninja, in about 30 s, into
``$HF_ZEROONE_CACHE`` (default ``$XDG_CACHE_HOME/hf_zeroone``, else ``~/.cache/hf_zeroone``), named
by a hash of the sources, the flags, torch's version, Python's extension ABI, the compiler's version
and the CPU's features, and checked against torch on a small sample before their first use in a
process (:mod:`hf_zeroone._cpu_kernels_check`). Without a compiler or ninja, or when the check
fails, a warning says so once and torch's operations run instead. ``HF_ZEROONE_CPU_KERNELS=0``
turns the kernels off.

Callers offer a list; each function here returns ``None`` where it does not take it (not all
float32 contiguous CPU tensors, the kernels off, or large tensors while torch runs several threads,
which torch would split over cores and one loop here would not), and the caller runs torch's form.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "adam_update_",
    "add_masked_",
    "add_masked_norms_",
    "apply_sync_",
    "all_finite",
    "scaled_difference",
    "scaled_difference_",
    "clip_to_bounds",
    "compression_error_",
    "decompress_",
    "decompress_sum_",
    "decompress_sum_norms_",
    "enabled",
    "from_update_units_",
    "from_update_units_norms_",
    "masked_ratio_norms",
    "norms",
    "pack_signs",
    "plain_denominators_",
    "scaled_denominators_",
    "split_denominators_",
    "update_unit_messages_",
    "update_unit_messages_norms_",
]

_SOURCES = (Path(__file__).with_name("_cpu_kernels.cpp"), Path(__file__).with_name("_cpu_kernels.c"))
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math")
#: torch splits an element-wise operation over threads only above this many elements (at::internal::GRAIN_SIZE)
_GRAIN = 32768
_ENV = "HF_ZEROONE_CPU_KERNELS"

_library: Any = None
_tried = False
#: whether the library's own 2-norm (``hz_norm2``) gave torch's bits in this process's check; if not, the norms
#: of :func:`masked_ratio_norms` come from torch's norm, one call per tensor
_own_norm = False
#: the thread that is loading and checking the library, ``None`` outside that (see _library_or_none)
_loading: threading.Thread | None = None
_init_lock = threading.RLock()
_log = logging.getLogger(__name__)


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


def _compiler() -> list[str]:
    """The C++ compiler's command (``$CXX``, which may carry a wrapper such as ``ccache g++``, else ``c++``)."""
    return shlex.split(os.environ.get("CXX") or "c++")


def _build_name() -> str:
    """The extension's name: a hash of what the build depends on, so no environment loads another's build.

    The sources and flags, torch's version, Python's extension ABI, the compiler's version and the
    CPU's features (``-march=native``).
    """
    try:
        version = subprocess.run([*_compiler(), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    parts = [p.read_bytes() for p in _SOURCES]
    context = (" ".join(_FLAGS), torch.__version__, sysconfig.get_config_var("EXT_SUFFIX") or "", version)
    parts += [s.encode() for s in (*context, platform.machine(), _cpu_features())]
    return "hf_zeroone_cpu_" + hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


@contextlib.contextmanager
def _building_alone(folder: Path, timeout_s: float = 900.0) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (released by the system when its holder dies), for at most ``timeout_s``.

    torch's own lock file is left behind by a process killed mid-build, and every later process
    then waits for it forever; inside this lock no one else is building, so it is removed.
    """
    import fcntl

    with open(folder / ".hf_zeroone.lock", "w") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held {folder} for {timeout_s:.0f} s") from None
                time.sleep(0.2)
            except OSError:  # a file system without locks (some network mounts): torch's own lock alone
                yield
                return
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load() -> Any:  # noqa: ANN401 - the compiled module
    if os.environ.get(_ENV, "1") == "0" or sys.platform == "win32":
        return None
    from torch.utils import cpp_extension

    compiler = _compiler()
    fix = f"install a C++ compiler (or set CXX) and ninja (pip install ninja), or set {_ENV}=0 to silence this"
    found = bool(compiler) and shutil.which(compiler[0]) is not None
    if not found or not cpp_extension.is_ninja_available():
        missing = f"no C++ compiler ({' '.join(compiler)!r})" if not found else "no ninja"
        warnings.warn(
            f"hf_zeroone: {missing} to build its fused CPU kernels; the optimizers' CPU steps run torch's "
            f"operations instead (the same results; the optimizer's step 1.5-2.3x slower): {fix}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    name = _build_name()
    folder = _cache_dir() / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _building_alone(folder):
            if not any(folder.glob("*.so")):  # said by the process that builds, not by those that waited
                _log.warning("hf_zeroone: building its fused CPU kernels in %s (once per machine, about 30 s)", folder)
            # compiled from copies inside the folder: torch rebuilds when the source's path changes, and
            # two installations of the same sources (two checkouts, two environments) then share one build
            for source in _SOURCES:
                copy = folder / source.name
                if not copy.exists() or copy.read_bytes() != source.read_bytes():
                    copy.write_bytes(source.read_bytes())
            return cpp_extension.load(
                name=name,
                sources=[str(folder / _SOURCES[0].name)],
                extra_cflags=list(_FLAGS),
                build_directory=str(folder),
                verbose=False,
            )
    except Exception as err:  # noqa: BLE001 - any failure to build or load leaves torch's operations
        warnings.warn(
            f"hf_zeroone: building its fused CPU kernels failed ({str(err).strip()[-500:]}); the optimizers' CPU "
            f"steps run torch's operations instead: {fix}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _library_or_none() -> Any:  # noqa: ANN401
    """The checked library, or ``None``; the first call loads and checks it.

    Kernels run on the communicator's thread too: while one thread loads and checks the library,
    the others wait here (the lock) rather than use a library not yet checked. The loading thread
    itself re-enters (the check calls the kernels).
    """
    global _library, _tried, _loading, _own_norm
    if _tried and _loading is None:
        return _library
    with _init_lock:
        if not _tried:
            _tried, _loading, _own_norm = True, threading.current_thread(), False
            try:
                _library = _load()
                if _library is not None and not _agrees_with_torch():
                    warnings.warn(
                        "hf_zeroone: its fused CPU kernels, as this machine's compiler built them, do not give "
                        f"torch's bits; the optimizers' CPU steps run torch's operations instead (set {_ENV}=0 to "
                        "silence this)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    _library = None
                _own_norm = _library is not None and _norm_agrees_with_torch()
            finally:
                _loading = None
        return _library


def enabled() -> bool:
    """Whether the kernels are built, checked and on in this process (builds them on the first call)."""
    return _library_or_none() is not None


def _ready(tensors: Sequence[Tensor]) -> Any:  # noqa: ANN401
    """The compiled module where ``tensors`` (a list's first) are on the CPU and the kernels are on, else ``None``."""
    if not tensors or not tensors[0].is_cpu:
        return None
    return _library_or_none()


def _limit() -> int:
    """Tensors of this many elements stay with torch (0: none), which splits them over its threads."""
    return _GRAIN if torch.get_num_threads() > 1 else 0


def all_finite(tensors: Sequence[Tensor]) -> bool | None:
    """Whether no element of any tensor is NaN or infinite (exact: read from the exponent bits)."""
    tensors = list(tensors)
    lib = _ready(tensors)
    found = -1 if lib is None else lib.all_finite(tensors, _limit())
    return None if found < 0 else bool(found)


def split_denominators_(roots: Sequence[Tensor], root_c2: float, scales: Tensor, eps: float) -> list[Tensor] | None:
    """From fresh ``roots = sqrt(v)``: new ``roots / root_c2 + eps``; ``roots`` become ``roots * scales[i] + eps``.

    ``scales``: one float32 per tensor. The scalars round to float32 as torch's 0-dim operands do.
    """
    roots = list(roots)
    lib = _ready(roots)
    return None if lib is None else lib.split_denominators(roots, root_c2, scales, eps, _limit())


def plain_denominators_(roots: Sequence[Tensor], root_c2: float, eps: float) -> bool:
    """``roots = roots / root_c2 + eps`` in place (fresh ``roots``); ``False`` where the kernels do not take them."""
    roots = list(roots)
    lib = _ready(roots)
    return lib is not None and lib.plain_denominators(roots, root_c2, eps, _limit())


def scaled_denominators_(roots: Sequence[Tensor], scales: Tensor, eps: float) -> bool:
    """``roots = roots * scales[i] + eps`` in place (fresh ``roots``); ``False`` where the kernels do not take them."""
    roots = list(roots)
    lib = _ready(roots)
    return lib is not None and lib.scaled_denominators(roots, scales, eps, _limit())


def clip_to_bounds(grads: Sequence[Tensor], dens: Sequence[Tensor], bound: float) -> list[Tensor] | None:
    """New ``maximum(minimum(g, d * bound), -(d * bound))`` for each pair (``torch.minimum``'s NaN rule)."""
    grads, dens = list(grads), list(dens)
    lib = _ready(grads)
    return None if lib is None else lib.clip_to_bounds(grads, dens, bound, _limit())


def masked_ratio_norms(
    grads: Sequence[Tensor], dens: Sequence[Tensor], floors: Tensor, masked: Sequence[bool]
) -> Tensor | None:
    """The 2-norm of each ``g / d``, 0 where ``d < floors[i]`` in the tensors ``masked`` names (float32 vector).

    ``torch._foreach_norm``'s bits: each ratio tensor is written into one scratch buffer and reduced
    there, in torch's order by the library's own loop where the load-time check found it to give
    torch's bits (:func:`._cpu_kernels_check.norm_agrees_with_torch`), else by torch's norm (a call
    per tensor, most of this function's time on a model of hundreds of small tensors). The ratios
    are not kept.
    """
    grads, dens = list(grads), list(dens)
    lib = _ready(grads)
    if lib is None:
        return None
    return lib.masked_ratio_norms(grads, dens, floors, [bool(m) for m in masked], _own_norm, _limit())


def norms(tensors: Sequence[Tensor]) -> Tensor | None:
    """The 2-norm of each tensor as one float32 vector, ``torch._foreach_norm``'s bits, in one call.

    Only where the load-time check found the library's own norm to give torch's bits
    (:func:`._cpu_kernels_check.norm_agrees_with_torch`); ``None`` otherwise, and the caller runs
    torch's norm.
    """
    tensors = list(tensors)
    lib = _ready(tensors)
    return None if lib is None or not _own_norm else lib.norms(tensors, _limit())


def adam_update_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    dens: Sequence[Tensor],
    weight: float,
    decay: float,
    value: float,
    divisors: Tensor | None = None,
) -> bool:
    """In place: ``m.lerp_(g, weight)``, ``p *= decay`` (unless 1), ``p.addcdiv_(m, d, value=value)``, in one pass.

    ``divisors`` (one float32 per tensor): each ``g`` is first divided by its own, as ``g / divisor``
    with a 0-dim float32 tensor rounds it (the gradient itself is not written). ``False`` (nothing
    written) where the kernels do not take the lists, or ``weight`` is not below 0.5 (torch's lerp
    takes another form there). Bumps the version counters of ``params`` and ``exp_avgs``, as
    torch's in-place operations do.
    """
    params = list(params)
    lib = _ready(params)
    if lib is None or not abs(float(np.float32(weight))) < 0.5:  # torch decides on the float32 weight
        return False
    return lib.adam_update(params, list(grads), list(exp_avgs), list(dens), weight, decay, value, divisors, _limit())


def scaled_difference_(
    outs: Sequence[Tensor], a: Sequence[Tensor], b: Sequence[Tensor], factors: Sequence[float]
) -> bool:
    """``out = a * factor - b`` per triple, into ``outs`` (torch's copy, ``_foreach_mul_`` and ``_foreach_sub_``).

    ``outs`` may be ``b`` itself (each element is read before it is written). Bumps the version
    counters of ``outs``. ``False`` (nothing written) where the kernels do not take the lists.
    """
    outs = list(outs)
    lib = _ready(outs)
    return lib is not None and lib.scaled_difference(outs, list(a), list(b), [float(f) for f in factors], _limit())


def scaled_difference(a: Sequence[Tensor], b: Sequence[Tensor], factors: Sequence[float]) -> list[Tensor] | None:
    """``a * factor - b`` per pair, as new contiguous tensors shaped like ``a``.

    ``None`` (nothing allocated) where the kernels do not take the lists.
    """
    a = list(a)
    lib = _ready(a)
    return None if lib is None else lib.scaled_difference_new(a, list(b), [float(f) for f in factors], _limit())


def update_unit_messages_(
    grads: Sequence[Tensor],
    clip_dens: Sequence[Tensor] | None,
    exp_avgs: Sequence[Tensor] | None,
    dens: Sequence[Tensor],
    outs: Sequence[Tensor],
    bound: float,
    weight: float,
    means: Tensor,
) -> bool:
    """Each 1-bit message in units of the update, into ``outs``, in one pass per tensor.

    ``g`` clipped to ``clip_dens * bound`` (unless ``clip_dens`` is ``None``), lerped from the
    momentum by ``weight`` (unless ``exp_avgs`` is ``None``), times ``means[i]``, over ``dens``:
    :func:`~hf_zeroone.optim._functional.clip_to_variance`, ``torch.lerp``, then
    :func:`~hf_zeroone.optim._functional.to_update_units`. ``False`` (nothing written) where the
    kernels do not take the lists.
    """
    grads = list(grads)
    lib = _ready(grads)
    return lib is not None and lib.update_unit_messages(
        grads, list(clip_dens or []), list(exp_avgs or []), list(dens), list(outs), bound, weight, means, _limit()
    )


def update_unit_messages_norms_(
    grads: Sequence[Tensor],
    clip_dens: Sequence[Tensor] | None,
    exp_avgs: Sequence[Tensor] | None,
    dens: Sequence[Tensor],
    outs: Sequence[Tensor],
    bound: float,
    weight: float,
    means: Tensor,
    floors: Tensor,
    masked: Sequence[bool],
    grad_norms: bool,
) -> tuple[Tensor | None, Tensor] | None:
    """:func:`update_unit_messages_`, and from the same pass the norms the exact lane carries.

    Returns each gradient's 2-norm (with ``grad_norms``, else ``None``) and the 2-norm of its masked
    ratios ``g / d`` (:func:`masked_ratio_norms` with ``floors`` and ``masked``), both
    ``torch._foreach_norm``'s bits; ``None`` (nothing written) where the kernels do not take the
    lists or the library's norm is off (:func:`norms`).
    """
    grads = list(grads)
    lib = _ready(grads)
    if lib is None or not _own_norm:
        return None
    found = lib.update_unit_messages_norms(
        grads, list(clip_dens or []), list(exp_avgs or []), list(dens), list(outs), bound, weight, means, floors,
        [bool(m) for m in masked], grad_norms, _limit(),
    )  # fmt: skip
    if found is None:
        return None
    g_norms, r_norms = found
    return (g_norms if grad_norms else None), r_norms


def from_update_units_(
    values: Sequence[Tensor], dens: Sequence[Tensor], exp_avgs: Sequence[Tensor] | None, means: Tensor, weight: float
) -> bool:
    """In place, ``v = (v * d) / means[i]``, then ``v = lerp(m, v, weight)`` when ``exp_avgs`` is given.

    :func:`~hf_zeroone.optim._functional.from_update_units`, then
    :func:`~hf_zeroone.optim._functional.implied_gradients`, in one pass per tensor.
    """
    values = list(values)
    lib = _ready(values)
    return lib is not None and lib.from_update_units(values, list(dens), list(exp_avgs or []), means, weight, _limit())


def from_update_units_norms_(
    values: Sequence[Tensor], dens: Sequence[Tensor], exp_avgs: Sequence[Tensor] | None, means: Tensor, weight: float
) -> Tensor | None:
    """:func:`from_update_units_`, and each result's 2-norm (``torch._foreach_norm``'s bits) from the same pass.

    ``None`` (nothing written) where the kernels do not take the lists or the library's norm is off
    (:func:`norms`).
    """
    values = list(values)
    lib = _ready(values)
    if lib is None or not _own_norm:
        return None
    return lib.from_update_units_norms(values, list(dens), list(exp_avgs or []), means, weight, _limit())


def pack_signs(x: Tensor) -> Tensor | None:
    """:func:`~hf_zeroone.compression.pack_signs` of a float32 CPU tensor in one pass, or ``None``."""
    lib = _ready([x])
    return None if lib is None else lib.pack_signs(x, _limit())


def compression_error_(
    x: Tensor, scales: Tensor, bounds: Sequence[int], out: Tensor, mask: Tensor | None = None
) -> bool:
    """``out = x - copysign(scales[s], x)`` on each segment (:func:`~hf_zeroone.compression.compression_error`).

    Then times ``mask`` (uint8, 0 or 1, as long as ``out``) when one is given, as ``out.mul_(mask)``.
    """
    lib = _ready([x])
    return lib is not None and lib.compression_error(x, scales, list(bounds), mask, out, _limit())


def decompress_(packed: Tensor, scales: Tensor, bounds: Sequence[int], out: Tensor, mask: Tensor | None = None) -> bool:
    """``out = +-1 * scales[s]`` from packed signs (:func:`~hf_zeroone.compression.decompress`), in one pass.

    Then times ``mask`` when one is given, as ``out.mul_(mask)``.
    """
    lib = _ready([out])
    return lib is not None and lib.decompress(packed, scales, list(bounds), mask, out, _limit())


def decompress_sum_(
    rows: Tensor, scales: Tensor, bounds: Sequence[int], error: Tensor, out: Tensor, mask: Tensor | None = None
) -> bool:
    """``out = C_0 + error + C_1 + ... + C_{P-1}``, in rank order, from ``P`` rows of packed signs.

    ``rows``: uint8 ``(P, row bytes)``, each row starting with one copy's packed signs;
    ``scales``: float32, ``P`` times the segments of ``bounds``, row by row. What
    :func:`~hf_zeroone.compression.decompress` of every row and a sum row by row give, in one pass;
    then times ``mask`` when one is given.
    """
    lib = _ready([out])
    return lib is not None and lib.decompress_sum(rows, scales, list(bounds), error, mask, out, _limit())


def decompress_sum_norms_(
    rows: Tensor,
    scales: Tensor,
    bounds: Sequence[int],
    error: Tensor,
    out: Tensor,
    mask: Tensor | None,
    zero_from: int,
    signs: Tensor | None = None,
) -> Tensor | None:
    """:func:`decompress_sum_`, then without a mask ``out[zero_from:] = 0``; returns each segment's 2-norm of ``out``.

    The norms are ``torch._foreach_norm``'s bits of the segments; ``None`` (nothing written) where the
    kernels do not take the arguments or the library's norm is off (:func:`norms`). With ``signs``
    (uint8, contiguous, ``(1, n)`` with ``8 * n >= out.numel()``), ``out``'s signs are written into its
    first bytes in the same pass, as :func:`~hf_zeroone.compression.pack_signs` packs them.
    """
    lib = _ready([out])
    if lib is None or not _own_norm:
        return None
    return lib.decompress_sum_norms(rows, scales, list(bounds), error, mask, zero_from, out, signs, _limit())


def add_masked_norms_(
    x: Tensor, e: Tensor, mask: Tensor | None, zero_from: int, bounds: Sequence[int], signs: Tensor | None = None
) -> Tensor | None:
    """``x = (x + e) * mask`` in place (without a mask ``x + e``, then ``x[zero_from:] = 0``); each segment's 2-norm.

    The norms are ``torch._foreach_norm``'s bits of the segments of the result; ``None`` (nothing
    written) where the kernels do not take the arguments or the library's norm is off (:func:`norms`).
    With ``signs`` (uint8, contiguous, ``(P, row bytes)``), the result's signs are written in the same
    pass as :func:`~hf_zeroone.compression.pack_signs` of ``x.view(P, -1)`` packs them, each chunk's
    into the first bytes of its row; every chunk (a multiple of 8 elements) must start a segment.
    """
    lib = _ready([x])
    if lib is None or not _own_norm:
        return None
    return lib.add_masked_norms(x, e, mask, zero_from, list(bounds), signs, _limit())


def add_masked_(x: Tensor, e: Tensor, mask: Tensor) -> bool:
    """``x = (x + e) * mask`` in place (torch's ``add_`` then ``mul_``), in one pass."""
    lib = _ready([x])
    return lib is not None and lib.add_masked(x, e, mask, _limit())


def apply_sync_(
    params: Sequence[Tensor],
    synced: Sequence[Tensor],
    us: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    dens: Sequence[Tensor],
    decays: Sequence[float],
    scales: Sequence[float],
    moved: Sequence[bool],
) -> bool:
    """0/1 Adam's sync in one pass per tensor (:func:`~hf_zeroone.optim._local_phase.apply_sync`).

    ``p = synced * decay - u``; where ``moved``, ``m = scale * u * d`` (torch's ``zero_`` and
    ``addcmul_``, one rounding: a product that underflows keeps its sign); then ``synced = p``.
    ``False`` (nothing written) where the kernels do not take the lists.
    """
    params = list(params)
    lib = _ready(params)
    return lib is not None and lib.apply_sync(
        params, list(synced), list(us), list(exp_avgs), list(dens),
        [float(f) for f in decays], [float(c) for c in scales], [bool(m) for m in moved], _limit(),
    )  # fmt: skip


def _norm_agrees_with_torch() -> bool:
    """The library's own 2-norm against torch's (:func:`hf_zeroone._cpu_kernels_check.norm_agrees_with_torch`)."""
    from hf_zeroone._cpu_kernels_check import norm_agrees_with_torch

    return norm_agrees_with_torch()


def _agrees_with_torch() -> bool:
    """Every kernel against the torch operations it stands for (:mod:`hf_zeroone._cpu_kernels_check`)."""
    from hf_zeroone._cpu_kernels_check import agrees_with_torch

    return agrees_with_torch()
