"""Running one spec: a ``torchrun --standalone`` subprocess of ``worker.py``, with a progress bar.

Each run gets its own directory (``spec.json``, ``run.log``, ``result.json``); a run that fails or
outlives its timeout is killed with its whole process group and reported with its log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def launch(spec: dict, nproc: int, timeout: float, bar, prefix: list[str] | None = None) -> dict:
    """One torchrun subprocess; returns rank 0's result, or an error with the log's tail (all ranks).

    ``prefix``: put before the command (``ip netns exec NAME`` to run every rank in a network namespace).
    """
    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", "progress.txt"):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += [str(HERE / "worker.py"), str(run_dir / "spec.json")]
    cmd = [*(prefix or []), *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.update(TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    log_path = run_dir / "run.log"
    start, last = time.perf_counter(), 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while proc.poll() is None:
            time.sleep(1.0)
            text = (run_dir / "progress.txt").read_text().split() if (run_dir / "progress.txt").exists() else []
            if len(text) == 3:
                step, total = int(text[0]), int(text[1])
                bar.total = total
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
    tail = log_path.read_text(errors="replace")[-6000:]
    return {**{k: spec[k] for k in ("workload", "optimizer")}, "error": why, "log_tail": tail, "wall_s": wall}


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
    """What a run of an hf_zeroone ``optimizer`` takes from the package without being told, or ``None``.

    Its constructor's defaults and the constants its schedule is derived from
    (``set_run_length``); with ``trainer``, also the defaults of the Trainer's arguments
    (``ZeroOneArgumentsMixin``), through which the run builds it. Recorded in the spec, so that
    a saved run made under other defaults is not taken for the run asked for now (:func:`same_run`).
    """
    if optimizer not in ("onebit_adam", "zeroone_adam"):
        return None
    import dataclasses
    import inspect

    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.optim import _schedule

    cls = OneBitAdam if optimizer == "onebit_adam" else ZeroOneAdam
    params = inspect.signature(cls.__init__).parameters.values()
    out = {p.name: repr(p.default) for p in params if p.default is not inspect.Parameter.empty}
    out.update(FREEZE_PERCENT=_schedule.FREEZE_PERCENT, LOCAL_PHASE_SYNCS=_schedule.LOCAL_PHASE_SYNCS)
    if trainer:
        from hf_zeroone.integrations.training_args import ZeroOneArgumentsMixin

        out["trainer"] = {f.name: repr(f.default) for f in dataclasses.fields(ZeroOneArgumentsMixin)}
    return out


def same_run(saved: dict, spec: dict) -> bool:
    """Whether a saved spec describes the run ``spec`` asks for, wherever the output directory now lies.

    The run directory is left out and the data directory compared by its name (which names what
    was generated), so that a copied or moved output directory keeps its runs.
    """

    def where_free(s: dict) -> dict:
        out = {k: v for k, v in s.items() if k != "run_dir"}
        if "data_dir" in out:
            out["data_dir"] = Path(out["data_dir"]).name
        return out

    return where_free(saved) == where_free(spec)


def run(spec: dict, nproc: int, timeout: float, desc: str, resume: bool = False) -> dict:
    """``launch`` with a progress bar; a failure's log tail goes to stderr.

    ``resume``: a run directory that already holds this spec (:func:`same_run`) and its result is
    not run again.
    """
    from tqdm.auto import tqdm

    run_dir = Path(spec["run_dir"])
    if resume and (run_dir / "result.json").exists() and (run_dir / "spec.json").exists():
        if same_run(json.loads((run_dir / "spec.json").read_text()), spec):
            return json.loads((run_dir / "result.json").read_text())

    with tqdm(desc=f"{desc}/{spec['optimizer']}", unit="step", leave=True, mininterval=2.0) as bar:
        result = launch(spec, nproc, timeout, bar)
    if "error" in result:
        print(
            f"[suite] {desc}/{spec['optimizer']} failed ({result['error']}):\n{result['log_tail']}",
            file=sys.stderr,
        )
    return result
