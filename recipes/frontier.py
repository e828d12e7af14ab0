#!/usr/bin/env python
"""The frontier: final held-out loss against whole-run bytes, hf_zeroone beside the local-step family.

One command, offline, CPU (gloo), 2 ranks::

    pip install -e ".[recipes,peers]"
    python recipes/frontier.py --output_dir outputs/frontier

Each method runs at several settings that span its bytes, on the suite's CLM and MLM pre-training
workloads (``convergence.py``'s data and models, smaller and longer: ``--steps``, 4,000 by
default), every run with the same data, initialisation, linear LR schedule (10% warm-up) and
gradient clipping:

* AdamW on DDP at ``--lr`` times 0.5, 1, 2, 4 and 8, and PowerSGD (rank 4) at 1x;
* torchft DiLoCo (inner AdamW, outer Nesterov SGD) at ``H`` = 8, 32, 128, 500 (outer lr 0.7), and
  at ``H`` = 32 with the inner lr at 0.5x, 2x and 4x and the outer lr at 0.5 and 1.0;
* DeMo (pytorch-optimizer) at top-k 8 and 32 of chunks of 64;
* torch's post-local SGD (AdamW, parameters averaged every 4, 16 or 64 steps after the warm-up);
* PowerSGD, DeMo (top-k 8 and 32) and post-local SGD (period 16) also at 2x and 4x the learning
  rate, and DeMo top-k 8 at 8x;
* 1-bit Adam with its default freeze (``set_run_length``) and a freeze at 10% and 5% of the run;
* 0/1 Adam with its defaults, with the variance frozen at 10% of the run (and at 10% and 5% with
  4x the learning rate), and with a largest sync gap of 64;
* 0/1 Adam with exact steps for the first 2.5% or 5% of the run only (``exact_warmup_steps``), then
  1-bit gradients between sparse variance steps until its freeze at 15%, 30% or 50% ("exact E%
  freeze F%"), at several learning rates, and with fewer variance steps (``var_update_scaler=8``,
  5% or 6.5% exact); and frozen at 7.5% with 4x the learning rate;
* the same with 5% exact and the freeze at 30%, and a largest sync gap (``local_step_clipper``)
  of 1, 2, 4 or 8 instead of 16 ("gap G"; 1: a 1-bit sync at every local-phase step);
* both at 2x and 4x the learning rate, their only knob shared with AdamW;
* both with their exact steps in full precision (``exact_step_dtype="float32"``), and 0/1 Adam
  with the paper's phase 1 (``exact_warmup_steps=0``: 1-bit gradients between sparse variance
  steps) at 1x and 4x.

Those hf_zeroone points send their exact steps in bf16 (named "... bf16"), the default when they
ran. These run with today's defaults (float8 exact steps): "1-bit Adam default", "0/1 Adam
default"; 0/1 Adam's 5%-exact setting with a largest sync gap of 1 or 2, its 2.5%- and 5%-exact
settings and its paper phase 1, each at 2x and 4x the learning rate (the paper phase 1 at 1x
too); and the cheapest points: the paper's phase 1 frozen at 2.5% of the run (1x, 2x, 4x) or
1.25% (4x), with ``var_update_scaler=4`` and a largest sync gap of 64 or 128, and at 2.5% with
gaps of 256 or 500 reached sooner (``local_step_scaler`` 10 or 5); two of them also with every
1-bit message averaged exactly in fp32 ("... exact messages", a diagnostic).

Every other knob is each package's default. Bytes and rounds are counted as in the convergence
suite (``suite/counting.py``; DiLoCo's fp32 pseudo-gradient allreduces, DeMo's own
``data_transmit`` checked against its all-gathers). Writes ``frontier.md`` (one table per workload:
loss, bytes per rank, rounds, and the loss against the best AdamW's), ``frontier.json`` and
``frontier_<workload>.png`` (loss against bytes, log x) into ``--output_dir``. Runs whose
directory holds the result of the same spec are not run again. ``--quick``: a smoke test.
"""

from __future__ import annotations

import itertools
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from convergence import SuiteArguments, make_spec, prepare_lm_data  # noqa: E402 - needs the path
from suite.launch import code_version, run  # noqa: E402

HF_ZEROONE = ("onebit_adam", "zeroone_adam")
#: the cheap 0/1 Adam points that the grid also runs with exact (fp32) messages
DIAGNOSED = (
    "0/1 Adam paper phase 1 freeze 2.5% var scaler 4 gap 64 lr x2",
    "0/1 Adam paper phase 1 freeze 2.5% var scaler 2 gap 500 local scaler 5 lr x1",
)
LABELS = {
    "adamw": "AdamW",
    "powersgd": "PowerSGD r4 + AdamW",
    "diloco": "DiLoCo (torchft)",
    "demo": "DeMo",
    "post_local_sgd": "post-local SGD",
    "onebit_adam": "1-bit Adam",
    "zeroone_adam": "0/1 Adam",
}


@dataclass
class FrontierArguments:
    output_dir: str = field(default="outputs/frontier", metadata={"help": "Tables, plots, run logs, data."})
    workloads: str = field(default="clm,mlm", metadata={"help": "Comma-separated: clm, mlm."})
    steps: int = field(default=4000, metadata={"help": "Optimizer steps of every run."})
    lr: float = field(default=1e-3, metadata={"help": "The suite's peak learning rate (1x)."})
    hidden_size: int = field(default=64, metadata={"help": "Model width."})
    num_layers: int = field(default=2, metadata={"help": "Transformer layers."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per rank and step."})
    seq_len: int = field(default=32, metadata={"help": "Tokens per sequence."})
    seed: int = field(default=0, metadata={"help": "Initialisation, data order and masks."})
    quick: bool = field(default=False, metadata={"help": "Tiny sizes and a short grid (smoke test)."})
    points: str = field(
        default="", metadata={"help": "Only these points, ';'-separated names as in the table (default: all)."}
    )
    timeout: int = field(default=1800, metadata={"help": "Seconds one run may take before it is killed."})


def grid(args: FrontierArguments) -> list[tuple[str, str, float, dict]]:
    """``(point name, method, lr multiplier, settings)`` for every point of the plot."""
    t = args.steps
    points = [(f"adamw lr x{m:g}", "adamw", m, {}) for m in (0.5, 1, 2, 4, 8)]
    points.append(("powersgd", "powersgd", 1, {}))
    points += [(f"diloco H={h}", "diloco", 1, {"sync_every": h}) for h in (8, 32, 128, 500)]
    points += [(f"diloco H=32 inner lr x{m:g}", "diloco", m, {"sync_every": 32}) for m in (0.5, 2, 4)]
    points += [(f"diloco H=32 outer lr {o:g}", "diloco", 1, {"sync_every": 32, "outer_lr": o}) for o in (0.5, 1.0)]
    # without outer momentum (lr 1: plain model averaging every H steps)
    points += [(f"diloco H={h} outer lr {o:g} no momentum", "diloco", 1, {"sync_every": h, "outer_lr": o,
                "outer_momentum": 0.0}) for h in (8, 128) for o in (0.7, 1.0)]  # fmt: skip
    points += [(f"demo top-k {k}", "demo", 1, {"compression_top_k": k}) for k in (8, 32)]
    points += [(f"post-local SGD period {p}", "post_local_sgd", 1, {"period": p}) for p in (4, 16, 64)]
    # the peers whose learning rate is AdamW's: at AdamW's best ones too (2x on MLM, 4x on CLM)
    for m in (2, 4):
        points.append((f"powersgd lr x{m}", "powersgd", m, {}))
        points += [(f"demo top-k {k} lr x{m}", "demo", m, {"compression_top_k": k}) for k in (8, 32)]
        points.append((f"post-local SGD period 16 lr x{m}", "post_local_sgd", m, {"period": 16}))
    points.append(("demo top-k 8 lr x8", "demo", 8, {"compression_top_k": 8}))  # better at 4x than 2x on both
    points.append(("1-bit Adam", "onebit_adam", 1, {}))
    points += [(f"1-bit Adam freeze {f}%", "onebit_adam", 1, {"freeze_step": max(1, t * f // 100)}) for f in (10, 5)]
    points.append(("0/1 Adam", "zeroone_adam", 1, {}))
    points.append(("0/1 Adam freeze 10%", "zeroone_adam", 1, {"var_freeze_step": max(2, t // 10)}))
    # a shorter exact phase at AdamW's best CLM learning rate: the cheapest points near its loss
    for f in (10, 5):
        points.append((f"0/1 Adam freeze {f}% lr x4", "zeroone_adam", 4, {"var_freeze_step": max(2, t * f // 100)}))
    # exact steps only at the start, then 1-bit gradients between sparse variance steps until the freeze
    hybrids = {(5, 30): (1, 2, 4, 8), (5, 15): (2, 4), (2.5, 15): (4,), (2.5, 30): (2, 4), (5, 50): (4,)}
    for (e, f), m in ((ef, m) for ef, ms in hybrids.items() for m in ms):
        settings = {"exact_warmup_steps": max(1, int(t * e / 100)), "var_freeze_step": max(2, t * f // 100)}
        name = f"0/1 Adam exact {e:g}% freeze {f}%" + (f" lr x{m}" if m != 1 else "")
        points.append((name, "zeroone_adam", m, settings))
    # a smaller largest sync gap than the default 16 (1: a sync every local-phase step); a sync costs 1/32 of
    # an fp32 step
    five_exact = {"exact_warmup_steps": t // 20, "var_freeze_step": t * 30 // 100}
    for g, m in ((1, 2), (1, 4), (2, 2), (2, 4), (4, 4), (8, 4)):
        settings = {**five_exact, "local_step_clipper": g}
        points.append((f"0/1 Adam exact 5% freeze 30% gap {g} lr x{m}", "zeroone_adam", m, settings))
    for e in (5, 6.5):  # fewer variance steps in phase 1 pay for more exact steps
        settings = {"exact_warmup_steps": int(t * e / 100), "var_freeze_step": t * 30 // 100, "var_update_scaler": 8}
        points.append((f"0/1 Adam exact {e:g}% freeze 30% var scaler 8 lr x4", "zeroone_adam", 4, settings))
    points += [(f"{n} lr x2", o, 2, {}) for n, o in (("1-bit Adam", "onebit_adam"), ("0/1 Adam", "zeroone_adam"))]
    points.append(("0/1 Adam freeze 7.5% lr x4", "zeroone_adam", 4, {"var_freeze_step": max(2, t * 75 // 1000)}))
    points.append(("0/1 Adam gap 64", "zeroone_adam", 1, {"local_step_clipper": 64}))
    points += [("1-bit Adam lr x4", "onebit_adam", 4, {}), ("0/1 Adam lr x4", "zeroone_adam", 4, {})]
    # the papers' exact steps: full precision, and 0/1 Adam's 1-bit gradients between sparse variance steps
    fp32 = {"exact_step_dtype": "float32"}
    points += [("1-bit Adam fp32 exact", "onebit_adam", 1, fp32), ("0/1 Adam fp32 exact", "zeroone_adam", 1, fp32)]
    paper = {"exact_warmup_steps": 0}
    points += [(f"0/1 Adam paper phase 1{x}", "zeroone_adam", m, paper) for x, m in (("", 1), (" lr x4", 4))]
    # every hf_zeroone point above ran with bf16 exact steps, the default until float8 replaced it (CHANGELOG):
    # they keep bf16, named so; the defaults and the 1/20 setting run again with today's (float8) below
    points = [
        (f"{n} bf16", o, m, {**s, "exact_step_dtype": "bfloat16"}) if o in HF_ZEROONE and not s.get("exact_step_dtype")
        else (n, o, m, s)
        for n, o, m, s in points
    ]  # fmt: skip
    points += [(f"{n} default", o, 1, {}) for n, o in (("1-bit Adam", "onebit_adam"), ("0/1 Adam", "zeroone_adam"))]
    for g, m in ((1, 2), (1, 4), (2, 2), (2, 4)):
        settings = {**five_exact, "local_step_clipper": g}
        points.append((f"0/1 Adam exact 5% freeze 30% gap {g} lr x{m}", "zeroone_adam", m, settings))
    # the cheapest settings with float8 exact steps, whose exact steps now cost half what they did
    for (e, f), m in itertools.product(((5, 30), (2.5, 30), (2.5, 15)), (2, 4)):  # 2x: AdamW's best on MLM
        settings = {"exact_warmup_steps": max(1, int(t * e / 100)), "var_freeze_step": max(2, t * f // 100)}
        points.append((f"0/1 Adam exact {e:g}% freeze {f}% lr x{m}", "zeroone_adam", m, settings))
    points += [
        (f"0/1 Adam paper phase 1{x}", "zeroone_adam", m, paper) for x, m in (("", 1), (" lr x2", 2), (" lr x4", 4))
    ]
    # below 80 MB, where DiLoCo's long intervals win: the paper's phase 1 frozen early, few variance steps,
    # long sync gaps (0/1 Adam as a local-step method)
    # (freeze %, var_update_scaler, largest gap, local_step_scaler or None: the default, lr multipliers); the
    # last three reach DiLoCo's budget with longer gaps, reached sooner
    cheap_points = [(2.5, 4, 64, None, (1, 2, 4)), (1.25, 4, 128, None, (4,))]
    cheap_points += [(2.5, 2, 500, 5, (1, 2)), (2.5, 4, 256, 10, (2,))]
    for f, scaler, g, ls, multipliers in cheap_points:
        cheap = {**paper, "var_freeze_step": max(2, int(t * f / 100)), "var_update_scaler": scaler}
        cheap["local_step_clipper"] = g
        name = f"0/1 Adam paper phase 1 freeze {f:g}% var scaler {scaler} gap {g}"
        if ls is not None:
            cheap["local_step_scaler"] = ls
            name += f" local scaler {ls}"
        points += [(f"{name} lr x{m}", "zeroone_adam", m, cheap) for m in multipliers]
    # a diagnostic, not a setting to use: the same with every 1-bit message averaged exactly in fp32
    # (the suite's exact_messages), to part what compression costs from what the local steps cost
    for name, _, m, settings in [p for p in points if p[0] in DIAGNOSED]:
        points.append((f"{name} exact messages", "zeroone_adam", m, {**settings, "exact_messages": True}))
    if args.quick:
        keep = ("adamw lr x1", "adamw lr x2", "diloco H=8", "demo top-k 8", "post-local SGD period 4")
        points = [p for p in points if p[0] in keep or p[0].endswith("default")]
    if args.points:
        wanted = [w.strip() for w in args.points.split(";") if w.strip()]
        unknown = sorted(set(wanted) - {p[0] for p in points})
        if unknown:
            raise ValueError(f"--points: unknown {unknown}; the points are: {'; '.join(p[0] for p in points)}")
        points = [p for p in points if p[0] in wanted]
    return points


def suite_arguments(args: FrontierArguments) -> SuiteArguments:
    sizes = dict(lm_hidden_size=args.hidden_size, lm_num_layers=args.num_layers, lm_batch_size=args.batch_size)
    sizes.update(lm_seq_len=args.seq_len, clm_steps=args.steps, mlm_steps=args.steps, lm_lr=args.lr)
    if args.quick:
        sizes.update(lm_hidden_size=32, lm_seq_len=16, lm_batch_size=4, clm_steps=40, mlm_steps=40)
        sizes.update(corpus_chars=150_000, vocab_size=512, lm_eval_sequences=16)
    else:
        sizes.update(corpus_chars=1_500_000, vocab_size=2048, lm_eval_sequences=256)
    return SuiteArguments(output_dir=args.output_dir, timeout=args.timeout, **sizes)


def table(workload: str, rows: list[dict]) -> list[str]:
    adamws = [r for r in rows if r["method"] == "adamw" and "error" not in r]
    best = min(adamws, key=lambda r: r["metric"]) if adamws else None
    lines = [
        f"### {workload}",
        "",
        "| point | held-out loss | vs best AdamW | MB sent / rank | bytes vs best AdamW | rounds | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted((r for r in rows if "error" not in r), key=lambda r: r["bytes"]):
        vs = f"{100 * (r['metric'] / best['metric'] - 1):+.2f}%" if best else "n/a"
        ratio = f"1/{best['bytes'] / r['bytes']:.1f}" if best and r["bytes"] else "n/a"
        lines.append(
            f"| {r['point']} | {r['metric']:.4f} | {vs} | {r['bytes'] / 1e6:.2f} | {ratio} | {r['rounds']} "
            f"| {r.get('wall_s', 0):.0f} |"
        )
    lines += [f"| {r['point']} | failed: {r['error']} | | | | | |" for r in rows if "error" in r]
    if best:
        lines += ["", f"Best AdamW: {best['point']} ({best['metric']:.4f}, {best['bytes'] / 1e6:.2f} MB per rank)."]
    return lines + [""]


def plot(workload: str, rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for method, label in LABELS.items():
        pts = sorted((r["bytes"], r["metric"]) for r in rows if r["method"] == method and "error" not in r)
        if pts:
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], "o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per rank over the whole run (log)")
    ax.set_ylabel("final held-out loss")
    ax.set_title(f"{workload}: loss against bytes")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"frontier_{workload}.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else argv
    (args,) = HfArgumentParser(FrontierArguments).parse_args_into_dataclasses(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    suite = suite_arguments(args)
    data = prepare_lm_data(suite, out)
    command = shlex.join(["python", "recipes/frontier.py", *argv])  # quoted: copied into a shell, it runs as it ran
    saved = json.loads((out / "frontier.json").read_text()) if (out / "frontier.json").exists() else {}
    results: dict[str, list[dict]] = saved.get("results", {})  # other workloads' rows are kept
    commands: dict[str, str] = saved.get("commands", {})
    for workload in args.workloads.split(","):
        rows = []
        commands[workload] = f"`{command}` (code {code_version()}; {suite.nproc} ranks, seed {args.seed})"
        for point, method, lr_mult, settings in grid(args):
            run_dir = out / "runs" / workload / point.replace(" ", "_").replace("%", "pc")
            spec = make_spec(suite, workload, method, data, run_dir, args.seed)
            spec.update(lr=suite.lm_lr * lr_mult, settings=settings)
            result = run(spec, suite.nproc, suite.timeout, f"{workload}/{point}", resume=True)
            rows.append({**result, "point": point, "method": method})
            results[workload] = rows
            (out / "frontier.json").write_text(json.dumps({"commands": commands, "results": results}))
        plot(workload, rows, out)
    lines = []
    for workload, rows in results.items():
        lines += [commands.get(workload, ""), "", *table(workload, rows)]
    (out / "frontier.md").write_text("\n".join(lines))
    print("\n" + "\n".join(lines))
    return results


if __name__ == "__main__":
    main()
