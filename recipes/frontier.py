#!/usr/bin/env python
"""The frontier: final held-out loss against whole-run bytes, hf_zeroone beside the peers (docs/frontier.md).

    pip install -e ".[recipes,peers]"
    python recipes/frontier.py --workloads clm,mlm --output_dir outputs/frontier
    python recipes/frontier.py --workloads clm --output_dir outputs/frontier --points 'adamw lr x4;diloco H=500'

Every point of ``grid`` (a method at one setting) runs on the suite's CLM and MLM workloads, smaller and longer.
Writes ``frontier.md`` (a table per workload), ``frontier.json`` and ``frontier_<workload>.png`` (loss against
bytes) into ``--output_dir``; a run whose directory holds the result of the same spec is not run again.
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convergence import SuiteArguments, make_spec, prepare_lm_data  # noqa: E402 - needs the path
from pretrain import arg  # noqa: E402
from suite.launch import code_version, parse, run  # noqa: E402
from suite.report import LABELS, figure  # noqa: E402

HF_ZEROONE = ("onebit_adam", "zeroone_adam")
BYTES_STEPS = 2000  # the run length of --shape bytes
BYTES_LR = 4e-3  # --shape bytes' 1x: AdamW's rate there (1e-3 under-trains it: +11% at 2,000 steps)
#: the cheap 0/1 Adam points that the grid also runs with exact (fp32) messages
DIAGNOSED = (
    "0/1 Adam paper phase 1 freeze 2.5% var scaler 4 gap 64 lr x2",
    "0/1 Adam paper phase 1 freeze 2.5% var scaler 2 gap 500 local scaler 5 lr x1",
)


@dataclass
class FrontierArguments:
    output_dir: str = arg("outputs/frontier", "Tables, plots, run logs, data.")
    workloads: str = arg("clm,mlm", "Comma-separated: clm, mlm.")
    steps: int = arg(4000, "Optimizer steps of every run.")
    lr: float = arg(1e-3, "The suite's peak learning rate (1x).")
    hidden_size: int = arg(64, "Model width.")
    num_layers: int = arg(2, "Transformer layers.")
    batch_size: int = arg(8, "Sequences per rank and step.")
    seq_len: int = arg(32, "Tokens per sequence.")
    seed: int = arg(0, "Initialisation, data order and masks.")
    shape: str = arg(
        "small",
        "small: the sizes above; bytes: a GPT-2 of 262 tokens (characters and a few merges), width 128, "
        "sequences of 128, batches of 16, 2,000 steps, and its own grid.",
    )
    quick: bool = arg(False, "Tiny sizes and a short grid (smoke test).")
    points: str = arg("", "Only these points, ';'-separated names as in the table (default: all).")
    timeout: int = arg(1800, "Seconds one run may take before it is killed.")


def bytes_grid(t: int) -> list[tuple[str, str, float, dict]]:
    """The second workload's points: AdamW's learning rates, 1-bit and 0/1 Adam's defaults and cheap settings,
    DiLoCo over H and outer learning rates, DeMo, post-local SGD and 1-bit DiLoCo."""
    ob, zo = "onebit_adam", "zeroone_adam"
    points = [(f"adamw lr x{m:g}", "adamw", m, {}) for m in (0.25, 0.5, 1, 2, 4)]  # 0.25: the suite's 1e-3
    points += [("1-bit Adam default", ob, 1, {}), ("0/1 Adam default", zo, 1, {})]
    points += [("1-bit Adam lr x2", ob, 2, {}), ("0/1 Adam lr x2", zo, 2, {})]
    cheap = {"exact_warmup_steps": 0, "var_freeze_step": max(2, t // 40), "var_update_scaler": 4}
    points += [(f"0/1 Adam paper phase 1 freeze 2.5% var scaler 4 gap {g}", zo, 1, {**cheap, "local_step_clipper": g})
               for g in (16, 64)]  # fmt: skip
    points += [(f"diloco H={h} outer lr {o:g}", "diloco", 1, {"sync_every": h, "outer_lr": o})
               for h in (8, 16, 32, 64, 128) for o in (0.5, 0.7, 1.0)]  # fmt: skip
    points += [(f"demo top-k {k}", "demo", 1, {"compression_top_k": k}) for k in (8, 32)]
    points += [(f"post-local SGD period {p}", "post_local_sgd", 1, {"period": p}) for p in (4, 16)]
    # 1-bit DiLoCo: its defaults (model averaging every 4 steps) over H, learning rate and passes per sync
    points += [("1-bit DiLoCo default", "onebit_diloco", 1, {})]
    points += [(f"1-bit DiLoCo lr x{m}", "onebit_diloco", m, {}) for m in (2, 4)]
    points += [(f"1-bit DiLoCo H={h}", "onebit_diloco", 1, {"sync_every": h}) for h in (2, 8, 16)]
    points += [("1-bit DiLoCo H=2 lr x2", "onebit_diloco", 2, {"sync_every": 2})]
    # half the drift between syncs: AdamW's rate inside, the average displacement doubled at each sync
    points += [("1-bit DiLoCo outer lr 2", "onebit_diloco", 1, {"outer_lr": 2.0})]
    points += [("1-bit DiLoCo 2 passes", "onebit_diloco", 1, {"sync_passes": 2})]
    # the inner AdamW's update direction averaged at every sync too (1-bit): less drift between syncs
    points += [(f"1-bit DiLoCo sync momentum{f' lr x{m}' if m > 1 else ''}", "onebit_diloco", m,
                {"sync_momentum": True}) for m in (1, 2, 4)]  # fmt: skip
    # the DiLoCo paper's outer step (Nesterov momentum 0.9, outer lr 0.7), with 1 and 4 passes per sync
    paper = {"outer_lr": 0.7, "outer_momentum": 0.9}
    points += [(f"1-bit DiLoCo H={h} paper outer", "onebit_diloco", 1, {"sync_every": h, **paper}) for h in (8, 16)]
    points += [(f"1-bit DiLoCo H={h} paper outer 4 passes", "onebit_diloco", 1,
                {"sync_every": h, **paper, "sync_passes": 4}) for h in (8, 16)]  # fmt: skip
    # diagnostics: the same syncs averaged exactly in fp32; with H=1 the replicas differ only in their AdamW states
    points += [("1-bit DiLoCo H=1 lr x2", "onebit_diloco", 2, {"sync_every": 1})]
    points += [(f"{n} exact messages", m, x, {**s, "exact_messages": True}) for n, m, x, s in points
               if n in ("1-bit DiLoCo default", "1-bit DiLoCo H=8 paper outer", "1-bit DiLoCo H=1 lr x2",
                        "1-bit DiLoCo sync momentum")]  # fmt: skip
    return points


def grid(args: FrontierArguments) -> list[tuple[str, str, float, dict]]:
    """``(point name, method, lr multiplier, settings)`` for every point of the plot."""
    t, ob, zo = args.steps, "onebit_adam", "zeroone_adam"
    if args.shape == "bytes":
        return select(bytes_grid(BYTES_STEPS), args.points)
    points = [(f"adamw lr x{m:g}", "adamw", m, {}) for m in (0.5, 1, 2, 4, 8)] + [("powersgd", "powersgd", 1, {})]
    points += [(f"diloco H={h}", "diloco", 1, {"sync_every": h}) for h in (8, 32, 128, 500)]
    points += [(f"diloco H=32 inner lr x{m:g}", "diloco", m, {"sync_every": 32}) for m in (0.5, 2, 4)]
    points += [(f"diloco H=32 outer lr {o:g}", "diloco", 1, {"sync_every": 32, "outer_lr": o}) for o in (0.5, 1.0)]
    # without outer momentum (outer lr 1: plain model averaging every H steps)
    points += [(f"diloco H={h} outer lr {o:g} no momentum", "diloco", 1, {"sync_every": h, "outer_lr": o,
                "outer_momentum": 0.0}) for h in (8, 128) for o in (0.7, 1.0)]  # fmt: skip
    points += [(f"demo top-k {k}", "demo", 1, {"compression_top_k": k}) for k in (8, 32)]
    points += [(f"post-local SGD period {p}", "post_local_sgd", 1, {"period": p}) for p in (4, 16, 64)]
    for m in (2, 4):  # the peers whose learning rate is AdamW's, at AdamW's best ones too (2x on MLM, 4x on CLM)
        points.append((f"powersgd lr x{m}", "powersgd", m, {}))
        points += [(f"demo top-k {k} lr x{m}", "demo", m, {"compression_top_k": k}) for k in (8, 32)]
        points.append((f"post-local SGD period 16 lr x{m}", "post_local_sgd", m, {"period": 16}))
    points += [("demo top-k 8 lr x8", "demo", 8, {"compression_top_k": 8}), ("1-bit Adam", ob, 1, {})]
    points += [(f"1-bit Adam freeze {f}%", ob, 1, {"freeze_step": max(1, t * f // 100)}) for f in (10, 5)]
    points += [("0/1 Adam", zo, 1, {}), ("0/1 Adam freeze 10%", zo, 1, {"var_freeze_step": max(2, t // 10)})]
    points += [(f"0/1 Adam freeze {f}% lr x4", zo, 4, {"var_freeze_step": max(2, t * f // 100)}) for f in (10, 5)]
    # exact steps only at the start, then 1-bit gradients between sparse variance steps until the freeze
    hybrids = {(5, 30): (1, 2, 4, 8), (5, 15): (2, 4), (2.5, 15): (4,), (2.5, 30): (2, 4), (5, 50): (4,)}
    for (e, f), m in ((ef, m) for ef, ms in hybrids.items() for m in ms):
        settings = {"exact_warmup_steps": max(1, int(t * e / 100)), "var_freeze_step": max(2, t * f // 100)}
        points.append((f"0/1 Adam exact {e:g}% freeze {f}%" + (f" lr x{m}" if m != 1 else ""), zo, m, settings))
    # a smaller largest sync gap than the default 16 (1: a sync at every local-phase step)
    five_exact = {"exact_warmup_steps": t // 20, "var_freeze_step": t * 30 // 100}
    for g, m in ((1, 2), (1, 4), (2, 2), (2, 4), (4, 4), (8, 4)):
        points.append((f"0/1 Adam exact 5% freeze 30% gap {g} lr x{m}", zo, m, {**five_exact, "local_step_clipper": g}))
    for e in (5, 6.5):  # fewer variance steps in phase 1 pay for more exact steps
        settings = {"exact_warmup_steps": int(t * e / 100), "var_freeze_step": t * 30 // 100, "var_update_scaler": 8}
        points.append((f"0/1 Adam exact {e:g}% freeze 30% var scaler 8 lr x4", zo, 4, settings))
    points += [("1-bit Adam lr x2", ob, 2, {}), ("0/1 Adam lr x2", zo, 2, {})]
    points.append(("0/1 Adam freeze 7.5% lr x4", zo, 4, {"var_freeze_step": max(2, t * 75 // 1000)}))
    points.append(("0/1 Adam gap 64", zo, 1, {"local_step_clipper": 64}))
    points += [("1-bit Adam lr x4", ob, 4, {}), ("0/1 Adam lr x4", zo, 4, {})]
    # the papers' exact steps: full precision, and 0/1 Adam's 1-bit gradients between sparse variance steps
    fp32, paper = {"exact_step_dtype": "float32"}, {"exact_warmup_steps": 0}
    points += [("1-bit Adam fp32 exact", ob, 1, fp32), ("0/1 Adam fp32 exact", zo, 1, fp32)]
    points += [(f"0/1 Adam paper phase 1{x}", zo, m, paper) for x, m in (("", 1), (" lr x4", 4))]
    # the hf_zeroone points above send their exact steps in bf16 (named so); those below, the package default
    points = [
        (f"{n} bf16", o, m, {**s, "exact_step_dtype": "bfloat16"}) if o in HF_ZEROONE and not s.get("exact_step_dtype")
        else (n, o, m, s)
        for n, o, m, s in points
    ]  # fmt: skip
    points += [("1-bit Adam default", ob, 1, {}), ("0/1 Adam default", zo, 1, {})]
    points += [("1-bit DiLoCo default", "onebit_diloco", 1, {})]
    points += [(f"1-bit DiLoCo lr x{m}", "onebit_diloco", m, {}) for m in (2, 4)]
    points += [(f"1-bit DiLoCo sync momentum lr x{m}", "onebit_diloco", m, {"sync_momentum": True}) for m in (2, 4)]
    for g, m in ((1, 2), (1, 4), (2, 2), (2, 4)):
        points.append((f"0/1 Adam exact 5% freeze 30% gap {g} lr x{m}", zo, m, {**five_exact, "local_step_clipper": g}))
    for (e, f), m in itertools.product(((5, 30), (2.5, 30), (2.5, 15)), (2, 4)):
        settings = {"exact_warmup_steps": max(1, int(t * e / 100)), "var_freeze_step": max(2, t * f // 100)}
        points.append((f"0/1 Adam exact {e:g}% freeze {f}% lr x{m}", zo, m, settings))
    points += [(f"0/1 Adam paper phase 1{x}", zo, m, paper) for x, m in (("", 1), (" lr x2", 2), (" lr x4", 4))]
    # the paper's phase 1 frozen early, few variance steps, long sync gaps: (freeze %, var_update_scaler,
    # largest gap, local_step_scaler or None for the default, lr multipliers)
    cheap_points = [(2.5, 4, 64, None, (1, 2, 4)), (1.25, 4, 128, None, (4,))]
    for f, scaler, g, ls, multipliers in cheap_points + [(2.5, 2, 500, 5, (1, 2)), (2.5, 4, 256, 10, (2,))]:
        cheap = {**paper, "var_freeze_step": max(2, int(t * f / 100)), "var_update_scaler": scaler}
        cheap["local_step_clipper"] = g
        name = f"0/1 Adam paper phase 1 freeze {f:g}% var scaler {scaler} gap {g}"
        if ls is not None:
            cheap["local_step_scaler"] = ls
            name += f" local scaler {ls}"
        points += [(f"{name} lr x{m}", zo, m, cheap) for m in multipliers]
    for name, _, m, settings in [p for p in points if p[0] in DIAGNOSED]:  # the same, 1-bit messages exact in fp32
        points.append((f"{name} exact messages", zo, m, {**settings, "exact_messages": True}))
    if args.quick:
        keep = ("adamw lr x1", "adamw lr x2", "diloco H=8", "demo top-k 8", "post-local SGD period 4")
        points = [p for p in points if p[0] in keep or p[0].endswith("default")]
    return select(points, args.points)


def select(points: list[tuple[str, str, float, dict]], names: str) -> list[tuple[str, str, float, dict]]:
    """The points named in ``names`` (';'-separated; empty: all)."""
    if not names:
        return points
    wanted = [w.strip() for w in names.split(";") if w.strip()]
    unknown = sorted(set(wanted) - {p[0] for p in points})
    if unknown:
        raise ValueError(f"--points: unknown {unknown}; the points are: {'; '.join(p[0] for p in points)}")
    return [p for p in points if p[0] in wanted]


def suite_arguments(args: FrontierArguments) -> SuiteArguments:
    """The convergence suite's arguments for the frontier's model, data and run length."""
    sizes = dict(lm_hidden_size=args.hidden_size, lm_num_layers=args.num_layers, lm_batch_size=args.batch_size)
    sizes.update(lm_seq_len=args.seq_len, clm_steps=args.steps, mlm_steps=args.steps, lm_lr=args.lr)
    if args.shape not in ("small", "bytes"):
        raise ValueError(f"--shape must be small or bytes, got {args.shape!r}")
    if args.shape == "bytes":  # 262 tokens: the corpus's characters, 6 special tokens, the most frequent merges
        sizes.update(lm_hidden_size=128, lm_seq_len=128, lm_batch_size=16, clm_steps=BYTES_STEPS, mlm_steps=BYTES_STEPS)
        sizes.update(lm_lr=BYTES_LR)
        sizes.update(corpus_chars=3_000_000, vocab_size=262, lm_eval_sequences=256)
    elif args.quick:
        sizes.update(lm_hidden_size=32, lm_seq_len=16, lm_batch_size=4, clm_steps=40, mlm_steps=40)
        sizes.update(corpus_chars=150_000, vocab_size=512, lm_eval_sequences=16)
    else:
        sizes.update(corpus_chars=1_500_000, vocab_size=2048, lm_eval_sequences=256)
    return SuiteArguments(output_dir=args.output_dir, timeout=args.timeout, **sizes)


def table(workload: str, rows: list[dict]) -> list[str]:
    """One workload's table, by bytes: loss, bytes and rounds, against the best AdamW's."""
    adamws = [r for r in rows if r["method"] == "adamw" and "error" not in r]
    best = min(adamws, key=lambda r: r["metric"]) if adamws else None
    lines = [f"### {workload}", ""]
    lines.append("| point | held-out loss | vs best AdamW | MB sent / rank | bytes vs best AdamW | rounds | wall s |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted((r for r in rows if "error" not in r), key=lambda r: r["bytes"]):
        vs = f"{100 * (r['metric'] / best['metric'] - 1):+.2f}%" if best else "n/a"
        ratio = f"1/{best['bytes'] / r['bytes']:.1f}" if best and r["bytes"] else "n/a"
        mb, wall = f"{r['bytes'] / 1e6:.2f}", f"{r.get('wall_s', 0):.0f}"
        lines.append(f"| {r['point']} | {r['metric']:.4f} | {vs} | {mb} | {ratio} | {r['rounds']} | {wall} |")
    lines += [f"| {r['point']} | failed: {r['error']} | | | | | |" for r in rows if "error" in r]
    if best:
        lines += ["", f"Best AdamW: {best['point']} ({best['metric']:.4f}, {best['bytes'] / 1e6:.2f} MB per rank)."]
    return lines + [""]


def plot(workload: str, rows: list[dict], out: Path) -> None:
    """``frontier_<workload>.png``: final loss against bytes, one colour per method."""
    with figure(out / f"frontier_{workload}.png", figsize=(8, 5)) as (_, ax):
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


def main(argv: list[str] | None = None) -> dict:
    """Run every point of the grid on every workload; other workloads' saved rows are kept."""
    args, command = parse(FrontierArguments, argv, "frontier.py")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    suite = suite_arguments(args)
    data = prepare_lm_data(suite, out)
    saved = json.loads((out / "frontier.json").read_text()) if (out / "frontier.json").exists() else {}
    results: dict[str, list[dict]] = saved.get("results", {})
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
