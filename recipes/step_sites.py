"""Where an optimizer step's kernel launches come from: hf_zeroone's source lines, counted.

``recipes/bench_step.py --profile`` uses it. Every torch call made while :func:`profile_step`
runs is wrapped, through a ``TorchFunctionMode``, in a profiler range named after the first
line of ``hf_zeroone`` on the Python stack; the profiler then counts, per line:

* **torch calls**: the calls the mode saw, attribute reads (``.shape``, ``.dtype``) included;
* **launches**: on CUDA the kernel launches (``cudaLaunchKernel`` and its kin, one per kernel;
  the table's last row gives the kernels the device ran, as a check); on the CPU the operators
  that do the work (ATen operators with no working operator beneath them, views and
  allocations left out): what a multi-tensor operation would fold into one call;
* **syncs**: waits of the host for the device (stream, event and device synchronisations), the
  benchmark's own wait for the step's kernels not counted;
* **host ms**: the time the host spent in the line's torch calls, profiler overhead included.

A line with hundreds of launches per step is a per-tensor loop, or a multi-tensor operation that
torch runs tensor by tensor (on CUDA: operands of different shapes, such as a list of per-tensor
0-dim scalars).
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable
from types import FrameType

import torch
from torch.overrides import TorchFunctionMode

import hf_zeroone

_LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
)
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_NOT_WORK = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::as_strided", "aten::view", "aten::reshape",
    "aten::_reshape_alias", "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::slice", "aten::expand",
    "aten::t", "aten::transpose", "aten::detach", "aten::detach_", "aten::alias", "aten::lift_fresh",
    "aten::resize_", "aten::split", "aten::unbind", "aten::split_with_sizes", "aten::narrow", "aten::result_type",
    "aten::to",
}  # fmt: skip
_PREFIX = "@"
_WHOLE = "hf_zeroone step (profiled)"
_DEVICE_KERNELS = "(kernels the device ran: a check of the launches)"


_PACKAGE = os.path.dirname(os.path.abspath(hf_zeroone.__file__)) + os.sep


def _site(frame: FrameType | None) -> str | None:
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_PACKAGE):
            return f"{path[len(_PACKAGE) :].replace(os.sep, '/')}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _works(name: str) -> bool:
    return name.startswith("aten::") and name not in _NOT_WORK


def _work_below(event, memo: dict[int, bool]) -> bool:  # noqa: ANN001
    """Whether any working operator runs anywhere beneath ``event``."""
    key = id(event)
    if key not in memo:
        memo[key] = any(_works(c.name) or _work_below(c, memo) for c in event.cpu_children)
    return memo[key]


class _Sites(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        site = _site(sys._getframe(1))
        if site is None:
            return func(*args, **(kwargs or {}))
        with torch.profiler.record_function(_PREFIX + site):
            return func(*args, **(kwargs or {}))


def _enclosing_site(event) -> str:  # noqa: ANN001
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(_PREFIX):
        parent = parent.cpu_parent
    return parent.name[len(_PREFIX) :] if parent is not None else "(no hf_zeroone line)"


def profile_step(step: Callable[[], object], cuda: bool) -> tuple[dict[str, dict[str, float]], float]:
    """Run ``step()`` once under the profiler: per source line calls, launches, syncs and host ms; the step's ms."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        with _Sites(), torch.profiler.record_function(_WHOLE):
            step()
        if cuda:
            torch.cuda.synchronize()  # the step's kernels inside the profile, this wait outside the step
    sites: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: dict.fromkeys(("calls", "launches", "syncs", "ms"), 0)
    )
    whole, memo, device_kernels = 0.0, {}, 0
    step_range = next(e for e in prof.events() if e.name == _WHOLE and e.device_type == torch.autograd.DeviceType.CPU)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            if not event.name.startswith(_PREFIX) and event.name != _WHOLE:  # the device's copy of a range
                device_kernels += 1
            continue
        if not (step_range.time_range.start <= event.time_range.start <= step_range.time_range.end):
            continue  # the benchmark's own wait after the step
        name = event.name
        if name == _WHOLE:
            whole += event.cpu_time_total / 1e3
        elif name.startswith(_PREFIX):
            row = sites[name[len(_PREFIX) :]]
            row["calls"] += 1
            row["ms"] += event.cpu_time_total / 1e3
        elif name in _SYNCS:
            sites[_enclosing_site(event)]["syncs"] += 1
        elif cuda and name in _LAUNCHES:
            sites[_enclosing_site(event)]["launches"] += 1
        elif not cuda and _works(name) and not _work_below(event, memo):
            sites[_enclosing_site(event)]["launches"] += 1
    if cuda:
        sites[_DEVICE_KERNELS] = {"calls": 0, "launches": device_kernels, "syncs": 0, "ms": 0}
    return dict(sites), whole


def sites_table(sites: dict[str, dict[str, float]], whole_ms: float, top: int = 12) -> str:
    """Markdown: the ``top`` lines by launches, the totals over all lines, and the whole step's host ms."""
    lines = ["| hf_zeroone line | torch calls | launches | syncs | host ms |", "|---|---:|---:|---:|---:|"]
    check = sites.get(_DEVICE_KERNELS)
    sites = {k: v for k, v in sites.items() if k != _DEVICE_KERNELS}
    ranked = sorted(sites.items(), key=lambda kv: (-kv[1]["launches"], -kv[1]["ms"]))
    for site, row in ranked[:top]:
        lines.append(f"| {site} | {row['calls']:.0f} | {row['launches']:.0f} | {row['syncs']:.0f} | {row['ms']:.2f} |")
    total = {k: sum(r[k] for r in sites.values()) for k in ("calls", "launches", "syncs", "ms")}
    lines.append(
        f"| all {len(sites)} lines | {total['calls']:.0f} | {total['launches']:.0f} | {total['syncs']:.0f} | "
        f"{total['ms']:.2f} |"
    )
    if check is not None:
        lines.append(f"| {_DEVICE_KERNELS} | | {check['launches']:.0f} | | |")
    lines.append(f"| whole step (Python included) | | | | {whole_ms:.2f} |")
    return "\n".join(lines)
