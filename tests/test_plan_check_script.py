"""tests/scripts/plan_check.py: the planner's bytes per step against a real run's, on a rate-limited link.

Needs root and ``ip``/``tc`` (network namespaces); skipped elsewhere. A tiny BERT for a few steps:
the step times are too short to hold the planner's 20% (``docs/planner.md`` has the full-size
check), but the bytes a rank sends are exact whatever the size, and the planner's loopback must
count what the two real ranks counted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

from bench.netns import netns_unavailable_reason  # noqa: E402 - needs the path

TINY = [
    "--layers", "2", "--hidden", "64", "--heads", "2", "--intermediate", "128", "--vocab", "512", "--seq_len", "16",
    "--batch_size", "4", "--steps", "12", "--warmup_steps", "2", "--var_freeze_step", "6", "--var_update_scaler", "1",
    "--local_step_scaler", "1", "--skip_steps", "1", "--zeroone_exact_warmup_steps", "2", "--netns_name",
    f"zo_plan_{os.getpid()}",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_projected_bytes_are_the_counted_bytes_of_a_real_run(tmp_path: Path) -> None:
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "plan_check.py"), "--results", str(tmp_path / "run"),
           "--rates", "100mbit", "--repeats", "1", "--", *TINY]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=550, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("| link | method | steps by kind |") :]  # the benchmark's own table is above
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| 100mbit |")]
    assert [r[1].strip() for r in rows] == ["DDP fp32", "1-bit Adam", "0/1 Adam"], proc.stdout
    for row in rows:
        projected, counted = (float(row[i].replace(",", "")) for i in (3, 4))
        assert counted > 0 and abs(projected / counted - 1) < 1e-3, row
        assert float(row[5]) > 0 and float(row[6]) > 0, row
    assert "largest error" in proc.stdout
