"""``tests/scripts/gpu_smoke.py`` on 2 gloo CPU ranks: its checks and its comparison run (the GPU run needs GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_smoke_script_checks_replicas_and_bytes_on_cpu_ranks(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out = tmp_path / "cpu.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "tests/scripts/gpu_smoke.py", "--device", "cpu", "--steps", "12", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["backend"] == "gloo" and report["problems"] == []
    for name in ("onebit", "zeroone"):
        run = report["runs"][name]
        assert run["replicas_identical"] and run["accounted_bytes"] == run["handed_bytes"] > 0
        assert len(set(run["kinds"])) >= 2
    same = subprocess.run(
        [sys.executable, "tests/scripts/gpu_smoke.py", "--compare", str(out), str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert same.returncode == 0 and same.stdout.strip().endswith("OK"), same.stdout + same.stderr


def test_the_smoke_script_parses():
    assert subprocess.run(["bash", "-n", str(REPO / "tests" / "scripts" / "gpu_smoke.sh")]).returncode == 0
