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
from test_cpu_kernels import kernels, pytestmark  # noqa: F401 - the fixture and the skip

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


def _longest_pause(call, repeats: int) -> tuple[float, float]:  # noqa: ANN001
    """One call's duration, and the longest this thread went without running while another thread made the call."""
    start = time.perf_counter()
    assert call() not in (None, False)  # the kernel took the list
    duration = time.perf_counter() - start
    done = threading.Event()

    def other() -> None:
        for _ in range(repeats):
            call()
        done.set()

    worker = threading.Thread(target=other)
    last, longest = time.perf_counter(), 0.0
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    return duration, longest


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("name", ["all_finite", "adam_update_"])
def test_another_python_thread_runs_while_a_kernel_runs(name: str) -> None:
    call = _calls()[name]
    n = 64
    while True:  # a call long enough to tell a held GIL (a pause as long as the call) from scheduling
        start = time.perf_counter()
        call(n)
        if time.perf_counter() - start > 0.05 or n >= 1 << 16:
            break
        n *= 2
    duration, longest = _longest_pause(lambda: call(n), repeats=4)
    assert duration > 0.02, f"a call of {duration * 1e3:.1f} ms is too short to tell"
    assert longest < duration / 2, (
        f"{name}: this thread stood still for {longest * 1e3:.1f} ms while a {duration * 1e3:.1f} ms call ran"
    )
