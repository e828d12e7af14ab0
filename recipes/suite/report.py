"""The convergence suite's ``results.md`` (table, seed-by-seed tables, goals) and plots; a row of several seeds is
their mean."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

OPTIMIZERS = ("adamw", "powersgd", "onebit_adam", "zeroone_adam")
LABELS = {"adamw": "AdamW", "powersgd": "PowerSGD r4 + AdamW", "diloco": "DiLoCo (torchft)", "demo": "DeMo",
          "post_local_sgd": "post-local SGD", "onebit_adam": "1-bit Adam", "zeroone_adam": "0/1 Adam",
          "onebit_diloco": "1-bit DiLoCo"}  # fmt: skip
GOAL_LOSS = {"clm": 1.01, "mlm": 1.01, "lsq": 1.25}  # mean final loss at most this times AdamW's
GOAL_EVERY_RUN = 1.02  # the run-length sweep (clm_200, clm_400, ...): every run, at its own seed
GOAL_ACC_POINTS = 0.5  # fine-tuning accuracy (mean over seeds) at most this many points below AdamW's
GOAL_ROUNDS, GOAL_BYTES, GOAL_MIN_STEPS = 0.4, 0.8, 1000  # 0/1 Adam against 1-bit Adam
MEANS = ("metric", "bytes", "rounds", "train_loss_last10pct", "train_wall_s", "wall_s")
GLOSSARY = (
    "Final metric: held-out loss at the end (clm, mlm: fixed sequences and masks; lsq: mean squared error on 4,096 "
    "held-out samples), held-out accuracy for finetune; rank 0's replica. vs AdamW: relative difference of the "
    "loss, or accuracy points. MB sent / rank: what one rank put on the wire (ring model: an allreduce of b bytes "
    "sends 2(P-1)/P b); hf_zeroone counts its own (`CommStats`), the AdamW and PowerSGD rows count every allreduce "
    "torch's DDP hook issues. Rounds: collective calls per rank (AdamW: one allreduce per DDP bucket per step; "
    "PowerSGD: 3 per bucket per compressed step, for the uncompressed tensors, P and Q; hf_zeroone: "
    "`CommStats.collectives`, 2 per 1-bit allreduce). PowerSGD runs one bucket at a time (see "
    "`suite/counting.one_bucket_at_a_time`). Train loss: rank 0's training loss over the last 10% of steps "
    "(finetune: the Trainer's logged `loss`, which on 2 ranks reads about twice the mean cross-entropy: 3.2 at "
    "chance with 5 classes, ln 5 = 1.61). Wall s: the training loop only, on a shared 2-core machine over loopback "
    "(not a network speed measure). Rows of several seeds: the mean over the seeds of every column (bytes, rounds "
    "and wall s per run). clm_T: the CLM workload at T steps (the run-length sweep)."
)


def mean_over_seeds(runs: dict[str, dict]) -> dict:
    """One optimizer's runs on several seeds as one row: the mean of ``MEANS``, else the first seed's fields."""
    failed = [seed for seed, r in runs.items() if "error" in r]
    if failed:
        first = runs[failed[0]]
        return {**first, "error": f"seed {failed[0]}: {first['error']}", "seeds": runs}
    row = dict(next(iter(runs.values())))
    row.update({key: sum(r[key] for r in runs.values()) / len(runs) for key in MEANS})
    return {**row, "seeds": runs}


def difference(workload: str, metric: float, base: float) -> float:
    """Against AdamW: accuracy points (finetune), or the loss's relative difference in percent."""
    return metric - base if workload == "finetune" else 100 * (metric / base - 1)


def paired_differences(run: dict, base: dict, workload: str = "finetune") -> list[float]:
    """``difference`` against AdamW seed by seed (one value for a run without ``seeds``)."""
    if "seeds" not in run or "seeds" not in base:
        return [difference(workload, run["metric"], base["metric"])]
    if set(run["seeds"]) != set(base["seeds"]):
        raise ValueError(f"seeds {sorted(run['seeds'])} are not AdamW's {sorted(base['seeds'])}")
    return [difference(workload, run["seeds"][s]["metric"], base["seeds"][s]["metric"]) for s in base["seeds"]]


def standard_error(values: list[float]) -> float | None:
    """Standard error of the mean (sample standard deviation / sqrt(n)); None for one value."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def goals(results: dict) -> list[tuple[str, str, str, bool | None]]:
    """(goal, run, measured, met) for every goal the runs can decide."""
    rows = []
    for workload, runs in results.items():
        base = runs.get("adamw")
        ok_base = base and "error" not in base
        for name, r in runs.items():
            if name == "adamw":
                continue
            label = f"{workload} / {LABELS[name]}"
            if "error" in r or not ok_base:
                rows.append(("run finished (with an AdamW baseline)", label, r.get("error", "no AdamW run"), False))
            elif workload == "finetune":
                diffs = paired_differences(r, base)
                diff, se = sum(diffs) / len(diffs), standard_error(diffs)
                goal, measured = f"accuracy >= AdamW - {GOAL_ACC_POINTS} points", f"{diff:+.2f} points"
                if len(diffs) > 1:
                    goal += f" (mean of {len(diffs)} paired seeds)"
                    measured += f" (seeds: {', '.join(f'{d:+.2f}' for d in diffs)}; standard error {se:.2f})"
                rows.append((goal, label, measured, diff >= -GOAL_ACC_POINTS))
            elif workload in GOAL_LOSS:
                ratio, goal = r["metric"] / base["metric"], f"final loss <= {GOAL_LOSS[workload]}x AdamW's"
                if len(r.get("seeds", {})) > 1:
                    goal += f" (means over {len(r['seeds'])} seeds)"
                rows.append((goal, label, f"{ratio:.4f}x", ratio <= GOAL_LOSS[workload]))
            else:  # the run-length sweep: every seed on its own
                diffs = paired_differences(r, base, workload)
                goal = f"every run's final loss <= {GOAL_EVERY_RUN}x AdamW's at its seed"
                measured = f"worst {max(diffs):+.2f}% (seeds: {', '.join(f'{d:+.2f}' for d in diffs)})"
                rows.append((goal, label, measured, max(diffs) <= 100 * (GOAL_EVERY_RUN - 1)))
        one, zo = runs.get("onebit_adam"), runs.get("zeroone_adam")
        if one and zo and "error" not in one and "error" not in zo:
            long_run = min(one["steps"], zo["steps"]) >= GOAL_MIN_STEPS
            note = "" if long_run else f" (run of {zo['steps']} steps < {GOAL_MIN_STEPS}: informative only)"
            label = f"{workload}, {zo['steps']} steps"
            for what, goal, key in (("rounds", GOAL_ROUNDS, "rounds"), ("bytes", GOAL_BYTES, "bytes")):
                ratio = zo[key] / one[key]
                met = ratio <= goal if long_run else None
                rows.append((f"0/1 Adam {what} <= {goal}x 1-bit Adam's{note}", label, f"{ratio:.3f}x", met))
    return rows


def markdown(results: dict, command: str, args: Any) -> str:  # noqa: ANN401 - the suite's dataclass
    """results.md: the table, the seed-by-seed tables, the glossary, the goals, the workloads and the settings."""
    head = "| workload | optimizer | final metric | vs AdamW | MB sent / rank | bytes vs AdamW | rounds "
    head += "| rounds vs AdamW | train loss (last 10%) | wall s |"
    lines = [f"Command: `{command}`", "", head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for workload, runs in results.items():
        base = runs.get("adamw")
        base = base if base and "error" not in base else None
        for name, r in sorted(runs.items(), key=lambda kv: OPTIMIZERS.index(kv[0])):
            if "error" in r:
                lines.append(f"| {workload} | {LABELS[name]} | failed: {r['error']} | | | | | | | {r['wall_s']:.0f} |")
                continue
            unit = " pts" if workload == "finetune" else "%"
            metric = f"{r['metric']:.2f} % acc" if workload == "finetune" else f"{r['metric']:.5g}"
            diff = f"{difference(workload, r['metric'], base['metric']):+.2f}{unit}" if base else "n/a"
            bx = f"{r['bytes'] / base['bytes']:.3f}" if base and base["bytes"] else "n/a"
            rx = f"{r['rounds'] / base['rounds']:.3f}" if base and base["rounds"] else "n/a"
            mb, loss = f"{r['bytes'] / 1e6:.2f}", f"{r['train_loss_last10pct']:.5g}"
            lines.append(
                f"| {workload} | {LABELS[name]} | {metric} | {diff} | {mb} | {bx} | {r['rounds']:.0f} | {rx} | {loss} "
                f"| {r['train_wall_s']:.0f} |"
            )
    for workload, runs in results.items():
        lines += seed_table(workload, runs)
    lines += ["", GLOSSARY, "", "### Goals", "", "| goal | run | measured | |", "|---|---|---:|---|"]
    for goal, run, measured, met in goals(results):
        lines.append(f"| {goal} | {run} | {measured} | {'met' if met else 'n/a' if met is None else 'MISSED'} |")
    lines += ["", "### Workloads", ""]
    for workload, runs in results.items():
        r = next((r for r in runs.values() if "error" not in r), None)
        if r:
            seeds = f", seeds {', '.join(r['seeds'])}" if "seeds" in r else ""
            line = f"- `{workload}`: {r['parameters']:,} parameters, {r['steps']} steps, {r['world_size']} ranks{seeds}"
            lines.append(line)
    lines += ["", f"Code: {getattr(args, 'code', 'unknown')}. Settings: " + json.dumps(asdict(args))]
    return "\n".join(lines) + "\n"


def seed_table(workload: str, runs: dict) -> list[str]:
    """One workload seed by seed: AdamW's metric, the others' differences from it, their mean."""
    base = runs.get("adamw")
    if not base or "error" in base or len(base.get("seeds", {})) < 2:
        return []
    others = [n for n in OPTIMIZERS if n in runs and n != "adamw" and "error" not in runs[n]]
    diffs = {n: paired_differences(runs[n], base, workload) for n in others}
    unit, fmt = ("accuracy points", "{:.2f}%") if workload == "finetune" else ("% of the loss", "{:.4f}")
    lines = ["", f"`{workload}` seed by seed ({unit} against AdamW's run of the same seed; the row above is "
             "the mean):", ""]  # fmt: skip
    lines += ["| seed | AdamW | " + " | ".join(LABELS[n] for n in others) + " |", "|---|---:|" + "---:|" * len(others)]
    for i, (seed, r) in enumerate(base["seeds"].items()):
        lines.append(
            f"| {seed} | {fmt.format(r['metric'])} | " + " | ".join(f"{diffs[n][i]:+.2f}" for n in others) + " |"
        )
    means = " | ".join(f"{sum(d) / len(d):+.2f}" for d in diffs.values())
    lines.append(f"| mean | {fmt.format(base['metric'])} | {means} |")
    lines.append("| standard error | | " + " | ".join(f"{standard_error(d):.2f}" for d in diffs.values()) + " |")
    return lines


@contextlib.contextmanager
def figure(path: Path, *grid: int, **kwargs: Any) -> Iterator[tuple]:  # noqa: ANN401
    """``(figure, axes)`` of ``plt.subplots`` (Agg), laid out and saved to ``path`` at the end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **kwargs)
    yield fig, axes
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(results: dict, out: Path) -> None:
    """``<workload>.png``: training loss against steps and against bytes sent."""
    for workload, runs in results.items():
        with figure(out / f"{workload}.png", 1, 2, figsize=(11, 4)) as (fig, (ax_step, ax_bytes)):
            for name, r in runs.items():
                if "error" in r:
                    continue
                losses = smooth([c[1] for c in r["curve"]], max(1, len(r["curve"]) // 40))
                ax_step.plot([c[0] for c in r["curve"]], losses, label=LABELS[name])
                pts = [(c[2] / 1e6, y) for c, y in zip(r["curve"], losses) if c[2] > 0]
                if pts:
                    ax_bytes.plot(*zip(*pts), label=LABELS[name])
            ax_step.set_xlabel("step")
            ax_bytes.set_xlabel("MB sent per rank (cumulative, log scale)")
            ax_bytes.set_xscale("log")
            for ax in (ax_step, ax_bytes):
                ax.set_ylabel("training loss (rank 0, smoothed)")
                if workload == "lsq":
                    ax.set_yscale("log")
                ax.legend()
            seeds = next((r["seeds"] for r in runs.values() if "seeds" in r), None)
            fig.suptitle(f"{workload}: loss curves" + (f" (seed {next(iter(seeds))})" if seeds else ""))


def smooth(values: list[float], window: int) -> list[float]:
    """Running mean over the last ``window`` values."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out
