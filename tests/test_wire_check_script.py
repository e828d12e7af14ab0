"""tests/scripts/wire_check.py: the suite's byte count of 0/1 Adam against the bytes its network namespace carried.

Needs root and ``ip`` (network namespaces); skipped elsewhere. The counted bytes must be those
``docs/frontier.md`` quotes, exactly (they depend on the schedule and the model's shapes only), and
the wire must carry no more than TCP/IP's overhead beyond them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

from bench.netns import netns_unavailable_reason  # noqa: E402 - needs the path


def _row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.timeout(900)
def test_zeroone_adams_counted_bytes_are_the_docs_and_the_wire_carries_them(tmp_path):
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "wire_check.py"), "--points", "0/1 Adam"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [*cmd, "--output_dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=850, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    measured = _row(proc.stdout, "0/1 Adam")
    documented = _row((ROOT / "docs" / "frontier.md").read_text(), "0/1 Adam")
    assert measured[1] == documented[1] and measured[3] == documented[3], (measured, documented)
    assert 1.0 <= float(measured[5]) <= 1.1, measured  # a missed collective would show as 2 or more
    assert re.fullmatch(r"[\d,]+", measured[2]) and re.fullmatch(r"[\d,]+", measured[4])
