"""Running one spec as a ``torchrun`` subprocess of ``workloads.py`` (its directory: ``spec.json``, ``run.log``,
``result.json``), and the parts the drivers share."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def parse(cls: type, argv: list[str] | None, script: str) -> tuple[Any, str]:
    """``cls`` from ``argv`` (default: the command line), and the command quoted to run as it ran in a shell."""
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else argv
    (args,) = HfArgumentParser(cls).parse_args_into_dataclasses(argv)
    return args, shlex.join(["python", f"recipes/{script}", *argv])


def launch(spec: dict, nproc: int, timeout: float, bar, prefix: list[str] | None = None) -> dict:  # noqa: ANN001
    """One torchrun subprocess (``prefix``: before the command); rank 0's result, or an error and the log's tail."""
    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", "progress.txt"):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [*(prefix or []), sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    cmd += [str(nproc), str(HERE / "workloads.py"), str(run_dir / "spec.json")]
    path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    log_path, progress = run_dir / "run.log", run_dir / "progress.txt"
    start, last = time.perf_counter(), 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while proc.poll() is None:
            time.sleep(1.0)
            text = progress.read_text().split() if progress.exists() else []
            if len(text) == 3:  # step, total, loss
                bar.total, step = int(text[1]), int(text[0])
                bar.update(step - last)
                bar.set_postfix(loss=text[2])
                last = step
            if time.perf_counter() - start > timeout:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                break
    wall = time.perf_counter() - start
    result_path = run_dir / "result.json"
    if proc.returncode == 0 and result_path.exists():
        result = {**json.loads(result_path.read_text()), "wall_s": wall}
        result_path.write_text(json.dumps(result))
        return result
    why = f"timed out after {timeout:.0f}s" if wall > timeout else f"exit code {proc.returncode}"
    failed = {"error": why, "log_tail": log_path.read_text(errors="replace")[-6000:], "wall_s": wall}
    return {"workload": spec["workload"], "optimizer": spec["optimizer"], **failed}


def code_version() -> str:
    """The commit the suite ran on, and whether ``hf_zeroone/`` had uncommitted changes then."""
    git = ["git", "-C", str(HERE.parents[1])]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "hf_zeroone"], capture_output=True, text=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    changed = len(dirty.stdout.splitlines())
    return head.stdout.strip() + (f" + uncommitted changes in {changed} hf_zeroone file(s)" if changed else "")


def package_defaults(optimizer: str, trainer: bool = False) -> dict | None:
    """What an hf_zeroone run takes from the package unasked (constructor, schedule, with ``trainer`` the Trainer's
    arguments), recorded in its spec so that a saved run of other defaults is run again; ``None`` for the others."""
    if optimizer not in ("onebit_adam", "zeroone_adam", "onebit_diloco"):
        return None
    import dataclasses
    import inspect

    from hf_zeroone import OneBitAdam, OneBitDiLoCo, ZeroOneAdam
    from hf_zeroone.optim import _schedule

    cls = {"onebit_adam": OneBitAdam, "zeroone_adam": ZeroOneAdam, "onebit_diloco": OneBitDiLoCo}[optimizer]
    params = inspect.signature(cls.__init__).parameters.values()
    out = {p.name: repr(p.default) for p in params if p.default is not inspect.Parameter.empty}
    out.update(FREEZE_PERCENT=_schedule.FREEZE_PERCENT, LOCAL_PHASE_SYNCS=_schedule.LOCAL_PHASE_SYNCS)
    if trainer:
        from hf_zeroone.integrations.training_args import ZeroOneArgumentsMixin

        out["trainer"] = {f.name: repr(f.default) for f in dataclasses.fields(ZeroOneArgumentsMixin)}
    return out


def same_run(saved: dict, spec: dict) -> bool:
    """Whether a saved spec is ``spec``'s run wherever the output directory lies (the data compared by its name)."""

    def where_free(s: dict) -> dict:
        return {**s, "run_dir": None, **({"data_dir": Path(s["data_dir"]).name} if "data_dir" in s else {})}

    return where_free(saved) == where_free(spec)


def run(spec: dict, nproc: int, timeout: float, desc: str, resume: bool = False) -> dict:
    """``launch`` with a progress bar (``resume``: a saved result of the same spec is returned instead)."""
    from tqdm.auto import tqdm

    run_dir = Path(spec["run_dir"])
    if resume and (run_dir / "result.json").exists() and (run_dir / "spec.json").exists():
        if same_run(json.loads((run_dir / "spec.json").read_text()), spec):
            return json.loads((run_dir / "result.json").read_text())
    with tqdm(desc=f"{desc}/{spec['optimizer']}", unit="step", leave=True, mininterval=2.0) as bar:
        result = launch(spec, nproc, timeout, bar)
    if "error" in result:
        print(f"[suite] {desc}/{spec['optimizer']} failed ({result['error']}):\n{result['log_tail']}", file=sys.stderr)
    return result
