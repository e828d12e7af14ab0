"""The fused CPU kernels run without the GIL: another Python thread goes on while one runs.

The communicator's thread runs the compressed allreduce's loops while the training thread runs
backward and the hook's Python code. A loop that held the GIL stopped every other Python thread
for its whole length (the 1-bit allreduce's arithmetic: 11-16 ms a step on the benchmark
model), even where a core was free.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_cpu_kernels import _own_norm_restored, kernels, pytestmark  # noqa: F401 - the fixtures and the skip

from hf_zeroone import _cpu_kernels

#: elements per tensor: under the size that the kernels leave to torch's threads
_N = 30_000


def _calls():  # noqa: ANN202
    """Two kernels, each one call over a long list (the same small tensors, repeated: little memory)."""
    x = torch.rand(_N) + 1.0
    big = torch.rand(_N) + 1.0
    ps, gs, ms = [torch.zeros(_N) for _ in range(3)]
    return {
        "all_finite": lambda n: _cpu_kernels.all_finite([x] * n),
        "adam_update_": lambda n: _cpu_kernels.adam_update_([ps] * n, [gs] * n, [ms] * n, [big] * n, 0.1, 1.0, -1e-9),
    }


def _windows_and_ticks(call, repeats: int) -> tuple[list[tuple[float, float]], list[float]]:  # noqa: ANN001
    """Each call's start and end on another thread, and when this thread ran meanwhile (a busy loop's ticks)."""
    windows: list[tuple[float, float]] = []
    failed: list[BaseException] = []

    def other() -> None:
        try:
            for _ in range(repeats):
                start = time.perf_counter()
                assert call() not in (None, False)  # the kernel took the list
                windows.append((start, time.perf_counter()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            failed.append(exc)

    worker = threading.Thread(target=other)
    ticks = [time.perf_counter()]
    worker.start()
    while worker.is_alive():
        now = time.perf_counter()
        if now - ticks[-1] > 1e-4:  # a tick every 0.1 ms at most: a short list
            ticks.append(now)
    worker.join()
    if failed:
        raise failed[0]
    return windows, ticks


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("name", ["all_finite", "adam_update_"])
def test_another_python_thread_runs_while_a_kernel_runs(name: str) -> None:
    call = _calls()[name]
    n = 64
    # Calls of a few hundred ms: a held GIL leaves the middle half of each silent, and a released
    # one leaves this thread runnable there long enough to be scheduled on a loaded machine (the
    # suite once ran beside two other copies of itself on two cores: 50 ms calls were too short).
    while True:
        start = time.perf_counter()
        assert call(n) not in (None, False)  # the kernel took the list
        if time.perf_counter() - start > 0.3 or n >= 1 << 18:
            break
        n *= 2
    windows, ticks = _windows_and_ticks(lambda: call(n), repeats=3)
    for start, end in windows:
        quarter = (end - start) / 4
        if quarter < 0.02:
            pytest.skip(f"a call of {(end - start) * 1e3:.1f} ms is too short to tell a held GIL from scheduling")
        # A held GIL lets this thread run at most one switch interval (5 ms) after the call began
        # (the worker takes it back to enter the loop), and never in the middle half of the call.
        inside = sum(start + quarter < t < end - quarter for t in ticks)
        assert inside > 0, (
            f"{name}: this thread never ran in the middle of a {(end - start) * 1e3:.1f} ms call on another thread"
        )
