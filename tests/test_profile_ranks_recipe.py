"""recipes/profile_ranks.py: each rank reports its step's medians and a row per timed function, per thread."""

import mmap
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


def _write_fresh_pages(pages: int) -> None:
    """Map ``pages`` new 4 KiB pages (small pages, whatever the allocator or huge-page setting) and write each."""
    size = pages * 4096
    memory = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    for offset in range(0, size, 4096):
        memory[offset] = 1
    memory.close()


def test_page_faults_count_the_fresh_memory_a_function_writes(monkeypatch):
    monkeypatch.syspath_prepend(str(RECIPE.parent))
    import profile_ranks

    if profile_ranks._RUSAGE_THREAD is None:
        pytest.skip("no per-thread getrusage here")
    probe = types.ModuleType("hz_fault_probe")
    probe.fresh = _write_fresh_pages
    probe.nothing = lambda pages: None
    monkeypatch.setitem(sys.modules, "hz_fault_probe", probe)
    timers = profile_ranks.Timers()
    timers.wrap("hz_fault_probe.fresh")
    timers.wrap("hz_fault_probe.nothing")
    timers.step = 0
    for _ in range(2):
        probe.fresh(4096)  # 16 MiB of new pages, each written once
        probe.nothing(4096)
    fresh, nothing = timers.calls[("hz_fault_probe.fresh", "main")], timers.calls[("hz_fault_probe.nothing", "main")]
    assert len(fresh) == 2 and all(faults >= 4096 for *_, faults in fresh), fresh
    assert all(faults < 100 for *_, faults in nothing), nothing


def test_it_says_how_to_start_it_and_refuses_a_skip_that_leaves_nothing():
    alone = subprocess.run([sys.executable, str(RECIPE)], capture_output=True, text=True, env=ENV, timeout=120)
    assert alone.returncode == 2 and "start it with torchrun" in alone.stderr
    cmd = [sys.executable, str(RECIPE), "--steps", "3", "--skip", "3"]
    bad = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert bad.returncode == 2 and "--skip must leave steps to time: 0 <= skip < steps, got 3 and 3" in bad.stderr


def test_a_function_that_ran_on_a_thread_in_only_some_steps_still_shows_its_calls():
    """A future's callback runs on the thread that completes it: on the training thread in some steps only."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import profile_ranks

    timers = profile_ranks.Timers()
    timers.calls[("m.finish", "main")] = [(1, 0.5, 0.002, 0.002, 0)]  # in step 1 of steps 0-2 only
    timers.calls[("m.finish", "comm")] = [(0, 0.4, 0.003, 0.003, 0), (2, 0.4, 0.003, 0.003, 0)]
    rows = {line.split(" | ")[1]: line for line in timers.report(first=0, steps=3)[2:]}
    assert rows["main"].endswith("| 0: 500.0, 2.00 |"), rows
    assert rows["comm"].endswith("| 0: 400.0, 3.00 |"), rows
