#!/usr/bin/env python
"""Run AdamW, 1-bit Adam and 0/1 Adam with the same seed and schedule; write a table and plots.

Pre-training (default; runs ``recipes/pretrain.py`` under ``accelerate launch`` on 2 CPU
processes, offline)::

    python recipes/compare.py --output_dir outputs/compare_mlm -- --max_steps 300

GLUE fine-tuning (runs ``recipes/run_glue.py`` under ``torchrun``; pass its arguments after
``--``)::

    python recipes/compare.py --recipe glue --output_dir outputs/compare_sst2 -- \\
        --task_name sst2 --train_file data/sst2/train.tsv --validation_file data/sst2/dev.tsv \\
        --do_train --do_eval --max_steps 200 --per_device_train_batch_size 16

Writes ``results.md`` (final loss / task metric, bytes per rank, collectives, wall time),
``results.json``, ``loss_vs_step.png`` and ``loss_vs_bytes.png`` (log axis) into
``--output_dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPTIMIZERS = ("adamw_torch", "onebit_adam", "zeroone_adam")
LABELS = {"adamw_torch": "AdamW (fp32 DDP)", "onebit_adam": "1-bit Adam", "zeroone_adam": "0/1 Adam"}


def run_one(recipe: str, optimizer: str, nproc: int, out: Path, extra: list[str]) -> dict:
    """Run one optimizer; return its curve (step, loss, bytes) and final numbers."""
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")
    if recipe == "pretrain":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc)]
        cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += [str(HERE / "pretrain.py"), "--optimizer", optimizer, "--output_dir", str(out), *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        cmd += [str(HERE / "run_glue.py"), "--optim_compression", optimizer, "--output_dir", str(out)]
        cmd += ["--use_cpu", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", *extra]
    print(f"[compare] {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    (out / "run.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "run.log").write_text(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(
            f"{optimizer} run failed (exit {proc.returncode}); see {out / 'run.log'}:\n{proc.stdout[-3000:]}"
        )
    if recipe == "pretrain":
        rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
        curve = [(r["step"], r["loss"], r["bytes_total"]) for r in rows]
        final = {"held-out loss": summary["eval_loss"], "train loss (last 20)": summary["train_loss_last20"]}
        return {
            "curve": curve,
            "final": final,
            "bytes": summary["bytes_sent_per_rank"],
            "fp32_bytes": summary["fp32_bytes_per_rank"],
            "collectives": summary["collectives"],
            "wall": wall,
        }
    state = json.loads((out / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "loss" in e]
    curve = [(e["step"], e["loss"], e.get("comm/bytes_total")) for e in logs]
    evals = json.loads((out / "eval_results.json").read_text()) if (out / "eval_results.json").exists() else {}
    final = {k.removeprefix("eval_"): v for k, v in evals.items() if not k.endswith(("runtime", "per_second"))}
    final = {k: v for k, v in final.items() if k not in ("epoch",)}
    fp32_total = logs[-1].get("comm/fp32_equivalent_bytes_total") if logs else None
    return {
        "curve": curve,
        "final": final,
        "bytes": logs[-1].get("comm/bytes_total") if logs else None,
        "fp32_bytes": fp32_total,
        "collectives": sum(e.get("comm/collectives", 0) for e in logs) or None,
        "wall": wall,
    }


def write_report(results: dict[str, dict], out: Path, command: str) -> str:
    """Markdown table + two PNG plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp32 = next((r["fp32_bytes"] for r in results.values() if r["fp32_bytes"]), None)
    for name, r in results.items():  # plain DDP: the fp32 ring volume of the same gradients
        if r["bytes"] is None and name == "adamw_torch" and fp32:
            r["bytes"] = fp32
            steps = r["curve"][-1][0] if r["curve"] else 1
            r["curve"] = [(s, loss, fp32 * s / steps) for s, loss, _ in r["curve"]]
    metric_names = sorted({k for r in results.values() for k in r["final"]})
    head = ["optimizer", *metric_names, "MB sent per rank", "vs AdamW", "collectives", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = results.get("adamw_torch", {}).get("bytes")
    for name, r in results.items():
        cells = [LABELS[name]]
        cells += [
            f"{r['final'][m]:.4f}" if isinstance(r["final"].get(m), float) else str(r["final"].get(m, ""))
            for m in metric_names
        ]
        cells.append(f"{r['bytes'] / 1e6:.2f}" if r["bytes"] else "n/a")
        cells.append(f"{r['bytes'] / base:.3f}" if r["bytes"] and base else "n/a")
        cells.append(str(r["collectives"]) if r["collectives"] is not None else "n/a")
        cells.append(f"{r['wall']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    note = (
        "Bytes: the package's own count of what rank 0 sent (CommStats); for AdamW the fp32 "
        "ring-allreduce volume of the same gradients. Collectives for AdamW count one DDP "
        "allreduce per step (DDP may split it into buckets)."
    )
    (out / "results.md").write_text(f"Command: `{command}`\n\n{table}\n\n{note}\n")
    (out / "results.json").write_text(json.dumps(results, indent=2))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        steps, losses = [c[0] for c in r["curve"]], [c[1] for c in r["curve"]]
        ax.plot(steps, _smooth(losses), label=LABELS[name])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (smoothed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_vs_step.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        pts = [(b, loss) for _, loss, b in r["curve"] if b]
        if pts:
            ax.plot([p[0] / 1e6 for p in pts], _smooth([p[1] for p in pts]), label=LABELS[name])
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per rank (cumulative, log scale)")
    ax.set_ylabel("training loss (smoothed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_vs_bytes.png", dpi=120)
    plt.close(fig)
    return table


def _smooth(values: list[float], window: int = 10) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def main() -> None:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=("pretrain", "glue"), default="pretrain")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run")
    parser.add_argument("--output_dir", default="outputs/compare")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = set(names) - set(OPTIMIZERS)
    if unknown:
        raise SystemExit(f"unknown optimizers {sorted(unknown)}; choose from {', '.join(OPTIMIZERS)}")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {name: run_one(args.recipe, name, args.nproc, out / name, extra) for name in names}
    command = shlex.join(["python", "recipes/compare.py", *sys.argv[1:]])  # quoted: it runs as it ran
    table = write_report(results, out, command)
    print("\n" + table + f"\n\nwrote {out / 'results.md'}, {out / 'loss_vs_step.png'}, {out / 'loss_vs_bytes.png'}")


if __name__ == "__main__":
    main()
