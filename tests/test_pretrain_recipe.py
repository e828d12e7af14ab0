"""recipes/pretrain.py and recipes/compare.py under `accelerate launch` with 2 CPU processes, offline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TINY = ["--max_corpus_chars", "150000", "--vocab_size", "512", "--hidden_size", "32", "--seq_len", "32",
        "--batch_size", "4", "--warmup_steps", "2", "--log_every", "2", "--eval_sequences", "16"]  # fmt: skip


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")


@pytest.mark.slow
def test_pretrain_clm_two_processes(tmp_path):
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(RECIPES / "pretrain.py"),
        "--objective", "clm", "--optimizer", "onebit_adam", "--max_steps", "6", "--output_dir", str(tmp_path), *TINY,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["args"]["objective"] == "clm"
    assert 0 < summary["bytes_sent_per_rank"] < summary["fp32_bytes_per_rank"]
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert {"exact", "onebit_momentum"} <= {r["kind"] for r in rows}
    assert "bytes sent by rank 0" in proc.stdout


@pytest.mark.slow
def test_compare_writes_table_and_plots(tmp_path):
    cmd = [sys.executable, str(RECIPES / "compare.py"), "--output_dir", str(tmp_path), "--", "--max_steps", "6", *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    table = (tmp_path / "results.md").read_text()
    for label in ("AdamW (fp32 DDP)", "1-bit Adam", "0/1 Adam"):
        assert f"| {label} |" in table
    assert "held-out loss" in table and "MB sent per rank" in table
    for png in ("loss_vs_step.png", "loss_vs_bytes.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["onebit_adam"]["bytes"] < results["adamw_torch"]["bytes"]


def test_bad_arguments_are_refused():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain", RECIPES / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    with pytest.raises(ValueError, match="--objective must be mlm or clm"):
        module.PretrainArguments(objective="seq2seq")
    with pytest.raises(ValueError, match="--optimizer must be"):
        module.PretrainArguments(optimizer="sgd")
