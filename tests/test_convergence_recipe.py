"""recipes/convergence.py in --quick mode: least squares on 2 CPU ranks, all four optimizers."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _load_suite():
    spec = importlib.util.spec_from_file_location("convergence", RECIPES / "convergence.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_suite_writes_table_goals_and_curves(tmp_path):
    cmd = [sys.executable, str(RECIPES / "convergence.py"), "--quick", "--workloads", "lsq", "--lsq_nproc", "2"]
    cmd += ["--output_dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    runs = json.loads((tmp_path / "results.json").read_text())["results"]["lsq"]
    assert set(runs) == {"adamw", "powersgd", "onebit_adam", "zeroone_adam"}
    for name, r in runs.items():
        assert r["world_size"] == 2 and r["steps"] == 64, name
        assert math.isfinite(r["metric"]) and r["metric"] > 0, name
        assert [c[0] for c in r["curve"]] == list(range(1, 65)), name
        assert all(math.isfinite(c[1]) for c in r["curve"]), name
        assert r["bytes"] > 0 and r["rounds"] > 0, name
    adamw = runs["adamw"]
    assert adamw["train_loss_last10pct"] < 0.5 * adamw["first_loss"]  # AdamW learns
    assert adamw["metric"] < 0.5 * adamw["first_loss"]
    # AdamW: one fp32 allreduce of all 4,128 gradients per step (one DDP bucket), 2 ranks: 4 bytes each
    assert adamw["rounds"] == 64 and adamw["bytes"] == 64 * 4128 * 4
    for name in ("powersgd", "onebit_adam", "zeroone_adam"):
        assert runs[name]["bytes"] < adamw["bytes"], name

    table = (tmp_path / "results.md").read_text()
    for label in ("| lsq | AdamW |", "| lsq | PowerSGD r4 + AdamW |", "| lsq | 1-bit Adam |", "| lsq | 0/1 Adam |"):
        assert label in table
    assert "### Goals" in table and "final loss <= 1.25x AdamW's" in table
    png = (tmp_path / "lsq.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_suite_arguments():
    suite = _load_suite()
    with pytest.raises(ValueError, match="--workloads: unknown"):
        suite.SuiteArguments(workloads="lsq,imagenet")
    with pytest.raises(ValueError, match="--optimizers: unknown"):
        suite.SuiteArguments(optimizers="sgd")
    quick = suite.SuiteArguments(quick=True, lsq_steps=80)
    assert quick.clm_steps == suite.QUICK["clm_steps"] and quick.lsq_steps == 80  # explicit values win
    spec = suite.make_spec(suite.SuiteArguments(), "lsq", "zeroone_adam", Path("d"), Path("r"), 0)
    assert (spec["steps"], spec["settings"], spec["lr"], spec["betas"]) == (
        640,
        {"var_freeze_step": 200},
        1e-2,
        [0.9, 0.99],
    )
    assert spec["batch_size"] == 16 and spec["warmup_steps"] == 0


def test_goals_are_decided_from_the_numbers():
    _load_suite()
    from suite import report as suite  # recipes/ is on sys.path once the suite is loaded

    def run(metric, steps=1000, sent=100, rounds=100):
        return {"metric": metric, "steps": steps, "bytes": sent, "rounds": rounds}

    results = {
        "clm": {
            "adamw": run(2.0, sent=1000, rounds=1000),
            "onebit_adam": run(2.01, sent=100, rounds=1000),
            "zeroone_adam": run(2.05, sent=70, rounds=300),
        },
        "finetune": {"adamw": run(80.0, 90), "powersgd": run(79.6, 90), "zeroone_adam": run(79.0, 90)},
    }
    verdicts = {(g.split(" (")[0], r): met for g, r, _, met in suite.goals(results)}
    assert verdicts[("final loss <= 1.01x AdamW's", "clm / 1-bit Adam")] is True
    assert verdicts[("final loss <= 1.01x AdamW's", "clm / 0/1 Adam")] is False
    assert verdicts[("0/1 Adam rounds <= 0.4x 1-bit Adam's", "clm, 1000 steps")] is True
    assert verdicts[("0/1 Adam bytes <= 0.8x 1-bit Adam's", "clm, 1000 steps")] is True
    assert verdicts[("accuracy >= AdamW - 0.5 points", "finetune / PowerSGD r4 + AdamW")] is True
    assert verdicts[("accuracy >= AdamW - 0.5 points", "finetune / 0/1 Adam")] is False


def test_finetune_goal_is_decided_on_the_mean_of_paired_seeds():
    """One seed's miss does not decide the goal; the mean of the seed-by-seed differences does."""
    suite = _load_suite()
    from suite import report

    def seeds(*accuracies):
        runs = {str(s): {"metric": a, "steps": 90, "bytes": 10, "rounds": 5} for s, a in enumerate(accuracies)}
        for r in runs.values():
            r.update(train_loss_last10pct=1.0, train_wall_s=2.0, wall_s=3.0, parameters=7, world_size=2)
        return report.mean_over_seeds(runs)

    adamw = seeds(89.84, 86.03, 90.79)
    results = {"finetune": {"adamw": adamw, "zeroone_adam": seeds(88.89, 88.25, 89.20)}}
    assert results["finetune"]["zeroone_adam"]["metric"] == pytest.approx((88.89 + 88.25 + 89.20) / 3)
    [(goal, _, measured, met)] = report.goals(results)
    assert goal == "accuracy >= AdamW - 0.5 points (mean of 3 paired seeds)"
    assert met is True and measured.startswith("-0.11 points (seeds: -0.95, +2.22, -1.59; standard error 1.18)")
    worse = {"finetune": {"adamw": adamw, "zeroone_adam": seeds(88.89, 86.03, 90.79)}}  # -0.32 on the mean
    assert report.goals(worse)[0][3] is True
    worse["finetune"]["zeroone_adam"] = seeds(88.89, 85.03, 90.79)  # -0.65 on the mean
    assert report.goals(worse)[0][3] is False
    table = report.markdown(results, "cmd", suite.SuiteArguments())
    assert "| 1 | 86.03% | +2.22 |" in table and "| mean | 88.89% | -0.11 |" in table
    assert "| standard error | | 1.18 |" in table and "90 steps, 2 ranks, seeds 0, 1, 2" in table
    with pytest.raises(ValueError, match="not AdamW's"):
        report.goals({"finetune": {"adamw": adamw, "zeroone_adam": seeds(88.0, 88.0)}})
    failed = report.mean_over_seeds({"0": adamw["seeds"]["0"], "1": {"error": "exit code 1"}})
    assert failed["error"] == "seed 1: exit code 1"


def test_suite_runs_finetune_once_per_seed(tmp_path, monkeypatch):
    """--finetune_seeds: one run per optimizer and seed, each seed its own split and Trainer seed."""
    suite = _load_suite()
    specs = []

    def fake_launch(spec, nproc, timeout, bar):  # stands in for the torchrun subprocess
        specs.append(spec)
        metric = 80.0 + spec["seed"] + (0.5 if spec["optimizer"] == "onebit_adam" else 0.0)
        return {"workload": "finetune", "optimizer": spec["optimizer"], "metric": metric, "bytes": 8, "rounds": 4,
                "steps": 9, "curve": [[1, 2.0, 8, 4]], "train_loss_last10pct": 1.0, "first_loss": 2.0,
                "train_wall_s": 1.0, "wall_s": 1.0, "parameters": 3, "world_size": 2}  # fmt: skip

    from suite import launch as launcher

    monkeypatch.setattr(launcher, "launch", fake_launch)
    argv = ["--workloads", "finetune", "--optimizers", "adamw,onebit_adam", "--finetune_seeds", "3,5"]
    results = suite.main([*argv, "--output_dir", str(tmp_path)])["finetune"]
    assert [(s["seed"], s["optimizer"]) for s in specs] == [
        (3, "adamw"), (3, "onebit_adam"), (5, "adamw"), (5, "onebit_adam")
    ]  # fmt: skip
    assert specs[0]["data_dir"] != specs[2]["data_dir"] and specs[0]["run_dir"] != specs[2]["run_dir"]
    splits = [json.loads(Path(specs[i]["data_dir"], "docstrings.json").read_text())["eval"] for i in (0, 2)]
    assert splits[0] != splits[1] and len(splits[0]) == len(splits[1])
    assert results["adamw"]["metric"] == 84.0 and set(results["onebit_adam"]["seeds"]) == {"3", "5"}
    table = (tmp_path / "results.md").read_text()
    assert "| finetune | 1-bit Adam | 84.50 % acc | +0.50 pts |" in table
    assert "(mean of 2 paired seeds) | finetune / 1-bit Adam | +0.50 points (seeds: +0.50, +0.50;" in table
    with pytest.raises(ValueError, match="--finetune_seeds"):
        suite.SuiteArguments(finetune_seeds="0,0")
    assert suite.SuiteArguments(quick=True).finetune_seeds == "0"


def test_finetune_seed_reaches_the_trainer(tmp_path):
    """--seed changes the head's initialisation and the data order, not only the split."""
    suite = _load_suite()
    from suite import workloads as convergence_finetune  # recipes/ is on sys.path once the suite is loaded

    for seed in (0, 3):
        spec = suite.make_spec(suite.SuiteArguments(), "finetune", "zeroone_adam", tmp_path, tmp_path, seed)
        args = convergence_finetune.training_arguments(spec)
        assert args.seed == seed
        assert args.optim_compression == "zeroone_adam" and args.max_grad_norm == 1.0  # Trainer defaults


def test_finetune_head_is_seeded():
    """Two runs of one spec, and every optimizer of one suite run, start from the same head."""
    _load_suite()
    from suite import workloads as convergence_finetune

    labels = list(convergence_finetune.PACKAGES)
    first, again = (convergence_finetune.pretrained_classifier(labels, seed=0) for _ in range(2))
    other = convergence_finetune.pretrained_classifier(labels, seed=1)
    assert torch.equal(first.classifier.weight, again.classifier.weight)
    assert not torch.equal(first.classifier.weight, other.classifier.weight)


def test_a_moved_output_directory_keeps_its_runs(tmp_path, monkeypatch):
    """A run whose saved spec differs only in where the output directory lies is not run again."""
    sys.path.insert(0, str(RECIPES))
    from suite import launch

    old = {"workload": "clm", "optimizer": "adamw", "lr": 1e-3}
    old.update(run_dir="/elsewhere/runs/clm/a", data_dir="/elsewhere/data/lm_1_2_3")
    run_dir = tmp_path / "runs" / "clm" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(old))
    (run_dir / "result.json").write_text(json.dumps({"metric": 4.2}))
    spec = dict(old, run_dir=str(run_dir), data_dir=str(tmp_path / "data" / "lm_1_2_3"))

    def no_launch(*args, **kwargs):
        raise AssertionError("the run was launched again")

    monkeypatch.setattr(launch, "launch", no_launch)
    assert launch.run(spec, 2, 60, "clm", resume=True) == {"metric": 4.2}
    # anything else that differs (here the data's parameters, or the learning rate) runs again
    assert not launch.same_run(old, dict(spec, data_dir=str(tmp_path / "data" / "lm_9_2_3")))
    assert not launch.same_run(old, dict(spec, lr=2e-3))


def test_finetune_data_of_other_parameters_is_another_directory(tmp_path, monkeypatch):
    """A saved fine-tuning run is reused only on the same documents: the data directory names them."""
    sys.path.insert(0, str(RECIPES))
    import convergence
    from suite import workloads as finetune

    monkeypatch.setattr(finetune, "docstring_dataset", lambda **kw: {"kw": kw})
    base = convergence.SuiteArguments(output_dir=str(tmp_path))
    dirs = {
        convergence.prepare_finetune_data(args, tmp_path, seed).name
        for args, seed in [
            (base, 0),
            (base, 1),
            (convergence.SuiteArguments(output_dir=str(tmp_path), finetune_per_class=8), 0),
            (convergence.SuiteArguments(output_dir=str(tmp_path), finetune_eval_fraction=0.2), 0),
        ]
    }
    assert len(dirs) == 4, dirs


def test_a_run_of_other_package_defaults_runs_again(monkeypatch):
    """A saved hf_zeroone run is reused only under the same defaults: the spec records them."""
    sys.path.insert(0, str(RECIPES))
    from suite import launch

    from hf_zeroone.optim import _schedule

    suite = _load_suite()
    args = suite.SuiteArguments()
    before = {name: suite.make_spec(args, "clm", name, Path("d"), Path("r"), 0) for name in ("onebit_adam", "adamw")}
    assert before["onebit_adam"]["package_defaults"]["exact_step_dtype"] == "torch.float8_e4m3fn"
    monkeypatch.setattr(_schedule, "FREEZE_PERCENT", _schedule.FREEZE_PERCENT + 10)
    after = {name: suite.make_spec(args, "clm", name, Path("d"), Path("r"), 0) for name in ("onebit_adam", "adamw")}
    assert not launch.same_run(before["onebit_adam"], after["onebit_adam"])
    assert launch.same_run(before["adamw"], after["adamw"])  # AdamW takes nothing from hf_zeroone
    finetune = suite.make_spec(args, "finetune", "zeroone_adam", Path("d"), Path("r"), 0)["package_defaults"]
    assert finetune["trainer"]["exact_step_dtype"] == "'float8_e4m3fn'"  # built through the Trainer's arguments


def _quick_onebit_lsq(out: Path, *extra: str) -> dict:
    cmd = [sys.executable, str(RECIPES / "convergence.py"), "--quick", "--workloads", "lsq", "--lsq_nproc", "2"]
    cmd += ["--optimizers", "onebit_adam", "--output_dir", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "results.json").read_text())["results"]["lsq"]["onebit_adam"]


@pytest.mark.slow
def test_settings_reach_the_optimizer_and_exact_messages_send_fp32(tmp_path):
    """--settings: a diagnostic row; exact messages separate compression's cost from the freeze's."""
    default = _quick_onebit_lsq(tmp_path / "default")
    exact = _quick_onebit_lsq(tmp_path / "exact", "--settings", '{"exact_messages": true, "clip_to_variance": false}')
    spec = json.loads(next((tmp_path / "exact" / "runs").rglob("spec.json")).read_text())
    assert spec["settings"]["exact_messages"] is True and spec["settings"]["clip_to_variance"] is False
    assert exact["replicas_equal"] and math.isfinite(exact["metric"])
    # the same steps and schedule, but the compressed steps' messages go as fp32 allreduces: more bytes
    assert exact["steps"] == default["steps"] and exact["rounds"] < default["rounds"]
    assert exact["bytes"] > default["bytes"]
    assert exact["metric"] != default["metric"]


def test_settings_that_are_not_a_json_object_stop_the_suite_before_any_run(tmp_path):
    suite = _load_suite()
    for bad in ("{bad", "[1]"):
        with pytest.raises(SystemExit, match="--settings"):
            suite.main(["--settings", bad, "--output_dir", str(tmp_path)])
    assert not (tmp_path / "runs").exists()


def test_settings_reach_the_finetune_rows_as_trainer_arguments_and_others_stop_the_suite(tmp_path):
    """--settings on finetune: Trainer argument fields reach it; an optimizer-only knob stops the suite."""
    suite = _load_suite()
    with pytest.raises(SystemExit, match=r"\['exact_messages'\] are not ZeroOneTrainingArguments fields"):
        suite.main(["--workloads", "finetune", "--settings", '{"exact_messages": true}', "--output_dir", str(tmp_path)])
    assert not (tmp_path / "runs").exists()
    from suite.workloads import training_arguments

    spec = {"optimizer": "zeroone_adam", "run_dir": str(tmp_path), "lr": 1e-4, "epochs": 1.0, "warmup_ratio": 0.1}
    spec.update(seed=0, log_every=5, settings={"exact_step_dtype": "float8_e4m3fn", "local_step_clipper": 1})
    args = training_arguments(spec)
    assert (args.exact_step_dtype, args.local_step_clipper, args.optim_compression) == (
        "float8_e4m3fn",
        1,
        "zeroone_adam",
    )
    with pytest.raises(ValueError, match="not ZeroOneTrainingArguments fields"):
        training_arguments({**spec, "settings": {"clip_to_variance": False}})
