"""recipes/profile_ranks.py: each rank reports its step's medians and a row per timed function, per thread."""

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "profile_ranks.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


@pytest.mark.slow
def test_both_ranks_report_the_hook_and_the_allreduce_on_their_threads(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(RECIPE)]
    cmd += ["--method", "onebit", "--steps", "6", "--skip", "4"]  # 1-bit momentum steps from step 3
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for rank in (0, 1):
        head = re.search(rf"rank {rank}, onebit, 2 steps after 4: ms per step \(medians\): (.*)", out)
        assert head, out
        medians = dict(part.rsplit(" ", 1) for part in head.group(1).split(", "))
        assert set(medians) == {"forward", "backward", "step", "total", "cpu"}
        assert all(float(v) > 0 for v in medians.values()), medians
    rows = re.findall(r"^\| (\S+) \| (main|comm) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| (.*) \|$", out, re.MULTILINE)
    found = {(name, thread) for name, thread, *_ in rows}
    assert ("hf_zeroone.ddp_hook.zeroone_hook", "main") in found, out  # the hook runs in backward
    assert ("hf_zeroone._two_stage.compressed_allreduce", "comm") in found, out  # its allreduce on the worker
    assert ("hf_zeroone.optim.onebit_adam.OneBitAdam:step", "main") in found, out
    for name, _, ms, cpu, _, calls in rows:
        assert float(ms) > 0 and re.fullmatch(r"\d+: [\d.]+, [\d.]+(; \d+: [\d.]+, [\d.]+)*", calls), (name, calls)
        assert 0 <= float(cpu) <= float(ms) + 0.01, (name, cpu, ms)  # a thread's CPU time within its wall time
    # a collective's wall time is mostly waiting, which its thread's CPU time leaves out
    collective = [(float(ms), float(cpu)) for name, _, ms, cpu, *_ in rows if name.endswith("_Collectives:all_to_all")]
    assert collective and all(cpu < ms for ms, cpu in collective), rows


def test_page_faults_count_the_fresh_memory_a_function_writes(monkeypatch):
    import torch

    monkeypatch.syspath_prepend(str(RECIPE.parent))
    import profile_ranks

    if profile_ranks._RUSAGE_THREAD is None:
        pytest.skip("no per-thread getrusage here")
    probe = types.ModuleType("hz_fault_probe")
    probe.fresh = lambda: torch.ones(16 * 2**20)  # a new 64 MiB tensor, every page written
    monkeypatch.setitem(sys.modules, "hz_fault_probe", probe)
    timers = profile_ranks.Timers()
    timers.wrap("hz_fault_probe.fresh")
    timers.step = 0
    for _ in range(2):
        probe.fresh()
    ((_, calls),) = timers.calls.items()
    # glibc maps a block this large afresh and unmaps it when freed: 16,384 pages of 4 KiB each call
    assert len(calls) == 2 and all(faults > 8000 for *_, faults in calls), calls
    assert all(0 < cpu for *_, cpu, _ in calls), calls  # the faults are the thread's own (kernel) CPU time


def test_it_says_how_to_start_it_and_refuses_a_skip_that_leaves_nothing():
    alone = subprocess.run([sys.executable, str(RECIPE)], capture_output=True, text=True, env=ENV, timeout=120)
    assert alone.returncode == 2 and "start it with torchrun" in alone.stderr
    cmd = [sys.executable, str(RECIPE), "--steps", "3", "--skip", "3"]
    bad = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert bad.returncode == 2 and "--skip must leave steps to time: 0 <= skip < steps, got 3 and 3" in bad.stderr
