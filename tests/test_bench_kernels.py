"""``recipes/bench_kernels.py`` runs on the CPU and prints its table (the GPU figures need a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("masked", ["0", "0.3"])
def test_bench_kernels_prints_the_table_on_cpu(tmp_path, masked):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "recipes/bench_kernels.py", "--device", "cpu", "--numel", "8192", "--world", "4",
           "--segments", "3", "--repeat", "2", "--json", str(out), "--masked", masked]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert f"3 segments, {float(masked):.0%} masked" in text
    assert "device: CPU" in text and "memory bandwidth (plain copy):" in text
    assert "| kernel | ms | GB/s | of memory bandwidth |" in text
    for kernel in ("copy (reference)", "pack_signs", "unpack_signs", "segment_scales", "compression_error",
                   "decompress", "compressed allreduce arithmetic (P=4)", "through the worker thread",
                   "float8 allreduce arithmetic (P=4, exact steps)"):  # fmt: skip
        assert f"| {kernel}" in text or kernel in text, kernel
    res = json.loads(out.read_text())
    assert res["numel"] == 8192 and len(res["rows"]) == 9
    assert (res["masked"] > 0) == (float(masked) > 0) and res["masked"] < 0.4 * 8192  # the layout timed was masked
    assert all(row["GB/s"] > 0 for row in res["rows"]) and res["rows"][0]["of_copy"] == 1.0


def test_bench_kernels_refuses_a_masked_fraction_outside_zero_to_one():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "recipes/bench_kernels.py", "--device", "cpu", "--masked", "1.5"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--masked is a fraction of the elements, in [0, 1); got 1.5" in proc.stderr
