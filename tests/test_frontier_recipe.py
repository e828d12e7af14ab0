"""recipes/frontier.py --quick: every method of the plot runs through its own package on 2 CPU ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.slow
def test_quick_frontier_runs_every_family_and_counts_their_bytes(tmp_path):
    for module in ("torchft", "pytorch_optimizer", "einops", "matplotlib"):
        pytest.importorskip(module)  # the [peers] extra
    cmd = [sys.executable, str(RECIPES / "frontier.py"), "--quick", "--workloads", "clm", "--output_dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = {r["point"]: r for r in json.loads((tmp_path / "frontier.json").read_text())["results"]["clm"]}
    assert not [p for p, r in rows.items() if "error" in r], rows
    assert {r["method"] for r in rows.values()} == {
        "adamw", "diloco", "demo", "post_local_sgd", "onebit_adam", "zeroone_adam", "onebit_diloco"
    }  # fmt: skip
    adamw, diloco = rows["adamw lr x1"], rows["diloco H=8"]
    assert rows["adamw lr x2"]["bytes"] == adamw["bytes"] and adamw["rounds"] == adamw["steps"] == 40
    # DiLoCo averages the fp32 pseudo-gradient of every parameter once every H=8 steps: exactly 1/8 of the bytes
    assert diloco["bytes"] * 8 == adamw["bytes"]
    for point in ("demo top-k 8", "1-bit Adam default", "0/1 Adam default", "post-local SGD period 4"):
        assert 0 < rows[point]["bytes"] < adamw["bytes"], point
    # the same syncs as DiLoCo H=8, in 1-bit signs and a scale per block: a small fraction of its fp32 bytes
    assert 0 < rows["1-bit DiLoCo default"]["bytes"] < diloco["bytes"] / 8
    for r in rows.values():
        assert r["replicas_equal"], r["point"]  # every method ends with one model (0/1 Adam: synchronize())
    table = (tmp_path / "frontier.md").read_text()
    assert "| adamw lr x2 |" in table and "Best AdamW:" in table
    assert (tmp_path / "frontier_clm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_recorded_command_runs_as_it_ran_when_copied_into_a_shell(tmp_path, monkeypatch):
    """``--points`` names hold spaces and ';': the command in the table must be quoted for a shell."""
    import shlex

    sys.path.insert(0, str(RECIPES))
    import frontier

    monkeypatch.setattr(frontier, "prepare_lm_data", lambda suite, out: tmp_path / "data")
    monkeypatch.setattr(frontier, "plot", lambda *a, **k: None)
    fake = {"metric": 4.0, "bytes": 10, "rounds": 1, "steps": 2}
    monkeypatch.setattr(frontier, "run", lambda spec, *a, **k: dict(fake, bytes=10 * spec["lr"] / 1e-3))
    argv = ["--workloads", "clm", "--output_dir", str(tmp_path), "--points", "adamw lr x1; adamw lr x2"]
    frontier.main(argv)
    recorded = json.loads((tmp_path / "frontier.json").read_text())["commands"]["clm"]
    command = recorded.split("`")[1]
    assert shlex.split(command) == ["python", "recipes/frontier.py", *argv]


def test_the_grid_names_the_exact_step_dtype_of_every_hf_zeroone_point():
    """Points that ran on the old bf16 default keep bf16 and say so; unsuffixed ones take today's default."""
    sys.path.insert(0, str(RECIPES))
    import frontier

    points = frontier.grid(frontier.FrontierArguments(output_dir="unused"))
    names = [p[0] for p in points]
    assert len(names) == len(set(names))
    for name, method, _, settings in points:
        if method not in frontier.HF_ZEROONE:
            continue
        dtype = settings.get("exact_step_dtype")
        assert name.endswith(" bf16") == (dtype == "bfloat16"), (name, settings)
        assert dtype in (None, "bfloat16", "float32"), (name, settings)  # None: the package default, float8
    defaults = {p[0]: p[3] for p in points if p[0].endswith("default")}
    assert defaults == {"1-bit Adam default": {}, "0/1 Adam default": {}, "1-bit DiLoCo default": {}}


def test_every_diagnosed_point_has_its_exact_messages_twin():
    """A renamed cheap point must not drop its diagnostic silently: the twin differs only in exact_messages."""
    sys.path.insert(0, str(RECIPES))
    import frontier

    settings = {p[0]: p[3] for p in frontier.grid(frontier.FrontierArguments(output_dir="unused"))}
    for name in frontier.DIAGNOSED:
        assert settings[f"{name} exact messages"] == {**settings[name], "exact_messages": True}


def test_the_byte_level_shape_has_its_own_sizes_and_grid():
    """``--shape bytes``: the second workload's sizes, run length and grid (DiLoCo over H and outer lr)."""
    sys.path.insert(0, str(RECIPES))
    import frontier

    args = frontier.FrontierArguments(output_dir="unused", shape="bytes")
    suite = frontier.suite_arguments(args)
    assert (suite.lm_hidden_size, suite.lm_seq_len, suite.lm_batch_size, suite.clm_steps) == (128, 128, 16, 2000)
    assert suite.vocab_size == 262 and suite.lm_lr == 4e-3  # AdamW's rate there: 1e-3 under-trains it
    points = frontier.grid(args)
    names = [p[0] for p in points]
    assert len(names) == len(set(names))
    diloco = {(p[3]["sync_every"], p[3]["outer_lr"]) for p in points if p[1] == "diloco"}
    assert diloco == {(h, o) for h in (8, 16, 32, 64, 128) for o in (0.5, 0.7, 1.0)}
    assert {"1-bit DiLoCo default", "1-bit Adam default", "0/1 Adam default", "demo top-k 8"} <= set(names)
    assert [
        p[0] for p in frontier.grid(frontier.FrontierArguments(output_dir="u", shape="bytes", points="demo top-k 8"))
    ] == ["demo top-k 8"]
    with pytest.raises(ValueError, match="--shape must be small or bytes"):
        frontier.suite_arguments(frontier.FrontierArguments(output_dir="unused", shape="wide"))
