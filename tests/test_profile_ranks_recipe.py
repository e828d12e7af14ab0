"""recipes/profile_ranks.py: each rank reports its step's medians and a row per timed function, per thread."""

import os
import re
import subprocess
import sys
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
    rows = re.findall(r"^\| (\S+) \| (main|comm) \| ([\d.]+) \| (.*) \|$", out, re.MULTILINE)
    found = {(name, thread) for name, thread, _, _ in rows}
    assert ("hf_zeroone.ddp_hook.zeroone_hook", "main") in found, out  # the hook runs in backward
    assert ("hf_zeroone._two_stage.compressed_allreduce", "comm") in found, out  # its allreduce on the worker
    assert ("hf_zeroone.optim.onebit_adam.OneBitAdam:step", "main") in found, out
    for name, _, ms, calls in rows:
        assert float(ms) > 0 and re.fullmatch(r"\d+: [\d.]+, [\d.]+(; \d+: [\d.]+, [\d.]+)*", calls), (name, calls)


def test_it_says_how_to_start_it_and_refuses_a_skip_that_leaves_nothing():
    alone = subprocess.run([sys.executable, str(RECIPE)], capture_output=True, text=True, env=ENV, timeout=120)
    assert alone.returncode == 2 and "start it with torchrun" in alone.stderr
    cmd = [sys.executable, str(RECIPE), "--steps", "3", "--skip", "3"]
    bad = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert bad.returncode == 2 and "--skip must leave steps to time: 0 <= skip < steps, got 3 and 3" in bad.stderr
