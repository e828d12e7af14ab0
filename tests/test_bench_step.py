"""recipes/bench_step.py: every phase is timed and reported, with the spread of its ratio over rounds."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _load():
    spec = importlib.util.spec_from_file_location("bench_step", RECIPES / "bench_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_table_gives_the_median_ratio_and_the_range_over_rounds():
    bench = _load()
    rounds = [
        {"AdamW(foreach=True)": [0.010, 0.010], "1-bit Adam: 1-bit momentum": [0.020, 0.020]},
        {"AdamW(foreach=True)": [0.010, 0.010], "1-bit Adam: 1-bit momentum": [0.030, 0.030]},
    ]
    lines = bench.table(rounds).splitlines()
    assert lines[2] == "| AdamW(foreach=True) | 10.00 | 1.00x | 1.00-1.00x |"
    assert lines[3] == "| 1-bit Adam: 1-bit momentum | 25.00 | 2.50x | 2.00-3.00x |"


def test_every_phase_runs_and_is_reported(tmp_path):
    cmd = [sys.executable, str(RECIPES / "bench_step.py"), "--layers", "1", "--width", "16", "--steps", "2"]
    cmd += ["--rounds", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    bench = _load()
    for name in ["AdamW(foreach=True)", *bench.PHASES]:
        assert name in rows, (name, proc.stdout)
        cells = [c.strip() for c in rows[name].strip("|").split("|")]
        assert float(cells[1]) > 0 and cells[2].endswith("x") and cells[3].endswith("x")


def test_loopback_runs_every_phase_with_the_message_maths_of_simulated_ranks(tmp_path):
    """``--loopback 2``: each phase's step runs the compressed exchange of 2 simulated ranks, and is reported."""
    cmd = [sys.executable, str(RECIPES / "bench_step.py"), "--layers", "1", "--width", "16", "--steps", "2"]
    cmd += ["--rounds", "1", "--loopback", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 simulated ranks (loopback" in proc.stdout
    for name in _load().PHASES:
        assert f"| {name} |" in proc.stdout, (name, proc.stdout)
    bad = subprocess.run([*cmd[:-1], "1"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert bad.returncode != 0 and "give 2 or more simulated ranks" in bad.stderr, bad.stderr[-2000:]


def test_state_hash_fingerprints_a_run_and_changes_with_it():
    spec = importlib.util.spec_from_file_location("state_hash", Path(__file__).with_name("_state_hash.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls, kwargs = module.RUNS["0/1 Adam"]
    first = module.fingerprint(cls, kwargs, steps=20)
    assert module.fingerprint(cls, kwargs, steps=20) == first and len(first) == 16
    assert module.fingerprint(cls, {**kwargs, "local_step_clipper": 2}, steps=20) != first
