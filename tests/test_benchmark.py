"""Smoke tests of ``recipes/benchmark.py``, run as a subprocess (only its namespace check is imported).

Both tests use a tiny BERT (2 layers, hidden 64) for a few steps on 2 ranks, so each takes well under two
minutes on two CPU cores. The second one needs root, ``ip`` and ``tc``: it runs inside a rate-limited network
namespace and checks that bytes really crossed the link and that the namespace is deleted afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes" / "benchmark.py"
TIMEOUT_S = 120
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TINY = [
    "--layers", "2", "--hidden", "64", "--heads", "2", "--intermediate", "128", "--vocab", "512",
    "--seq_len", "16", "--batch_size", "4", "--steps", "6", "--warmup_steps", "2", "--var_freeze_step", "4",
    "--var_update_scaler", "1", "--local_step_scaler", "1", "--nocomm_steps", "4", "--skip_steps", "1",
    "--log_every", "3", "--timeout", str(TIMEOUT_S - 20),
    "--zeroone_exact_warmup_steps", "2",  # 0/1 Adam's 1-bit gradient steps between the warm-up and the freeze
]  # fmt: skip


def run_benchmark(out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run the recipe with the tiny model; fail with its output if it fails or times out."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(SCRIPT), *TINY, "--output_dir", str(out_dir), *extra]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"benchmark did not finish in {TIMEOUT_S} s\nstdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")
    assert res.returncode == 0, f"benchmark failed ({res.returncode})\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    return res


def check_outputs(out_dir: Path, stdout: str, methods: list[str], rates: list[str]) -> dict:
    """Common checks: JSON structure, markdown rows for every (rate, method), non-empty PNGs."""
    report = json.loads((out_dir / "results.json").read_text())
    for key in ("command", "mode", "netns", "args", "numel", "configs", "wall_s", "plots"):
        assert key in report, f"results.json has no {key!r}"
    assert report["numel"] > 0
    assert [c["rate"] for c in report["configs"]] == rates
    for config in report["configs"]:
        assert list(config["methods"]) == methods
        for name, summary in config["methods"].items():
            for key in ("phases", "whole_run", "loss_last_tenth", "curves", "main_phase"):
                assert key in summary, f"{name}: no {key!r}"
            whole = summary["whole_run"]
            assert whole["steps"] == report["args"]["steps"]
            assert whole["accounted_bytes_per_step_per_rank"] > 0
            assert whole["median_step_ms"] > 0 and whole["samples_per_s"] > 0
            assert len(summary["curves"]["loss"]) == whole["steps"]
            assert all(0 < v < 20 for v in summary["curves"]["loss"]), summary["curves"]["loss"]

    markdown = (out_dir / "results.md").read_text()
    assert markdown in stdout, "the markdown report is not printed at the end"
    labels = {m: summary["label"] for m, summary in report["configs"][0]["methods"].items()}
    for rate in rates:
        for method in methods:
            row = f"| {rate} | {labels[method]} |"
            assert row in markdown, f"no table row starting {row!r}"

    assert sorted(report["plots"]) == ["loss_vs_bytes.png", "throughput_vs_rate.png"]
    for name in report["plots"]:
        data = (out_dir / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), f"{name} is not a PNG"
    return report


@pytest.mark.slow
def test_benchmark_without_netns(tmp_path: Path) -> None:
    res = run_benchmark(tmp_path, "--no-netns", "--methods", "ddp_fp32,zeroone")
    assert "NO network namespace" in res.stdout  # says that nothing was throttled
    report = check_outputs(tmp_path, res.stdout, ["ddp_fp32", "zeroone"], ["host-loopback"])
    assert report["netns"] is False
    methods = report["configs"][0]["methods"]
    zo = methods["zeroone"]
    assert list(zo["phases"]) == ["warm-up", "compression", "local"]
    assert {"exact", "onebit_gradient", "onebit_sync"} <= {k for ph in zo["phases"].values() for k in ph["kinds"]}
    assert zo["whole_run"]["wire_bytes_per_step_per_rank"] is None  # not measured without a namespace
    # 1-bit messages in the local phase are far smaller than fp32 gradients
    fp32 = methods["ddp_fp32"]["whole_run"]["accounted_bytes_per_step_per_rank"]
    assert zo["phases"]["local"]["accounted_bytes_per_step_per_rank"] < fp32 / 10


def _netns_skip_reason() -> str | None:
    """The recipe's own check (loaded from its file; the recipes folder is not a package)."""
    spec = importlib.util.spec_from_file_location("zo_benchmark_recipe", SCRIPT)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe.netns_unavailable_reason()


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@pytest.mark.slow
def test_benchmark_in_rate_limited_netns(tmp_path: Path) -> None:
    reason = _netns_skip_reason()
    if reason:
        pytest.skip(reason)
    name = f"zo_test_{os.getpid()}"
    try:
        res = run_benchmark(tmp_path, "--rates", "100mbit", "--methods", "ddp_fp32,onebit", "--netns_name", name)
        if "could not create a network namespace" in res.stdout:
            pytest.skip("root, but this machine does not allow network namespaces (missing CAP_NET_ADMIN?)")
        report = check_outputs(tmp_path, res.stdout, ["ddp_fp32", "onebit"], ["100mbit"])
        assert report["netns"] is True
        config = report["configs"][0]
        assert config["netns_tx_bytes"] > 0, "no traffic through the namespace loopback"
        for method, summary in config["methods"].items():
            whole = summary["whole_run"]
            assert whole["wire_bytes_total"] > 0, method
            # the wire carries the accounted payload plus TCP/IP headers, ACKs and a few barriers
            assert 0.95 < whole["wire_over_accounted"] < 1.5, (method, whole["wire_over_accounted"])
        onebit = config["methods"]["onebit"]["phases"]["compression"]["wire_bytes_per_step_per_rank"]
        fp32 = config["methods"]["ddp_fp32"]["whole_run"]["wire_bytes_per_step_per_rank"]
        assert onebit < fp32 / 8, (onebit, fp32)
        assert name not in _namespaces(), f"namespace {name} left behind"
    finally:
        if name in _namespaces():  # never leave one behind, even when the assertions fail
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
