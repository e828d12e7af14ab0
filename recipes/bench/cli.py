"""Parent process of ``recipes/benchmark.py``: the command line, the link, the ranks, the report and the plots."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from suite.report import figure

from bench.measure import METHODS, prepare_text_blocks
from bench.netns import NetNamespace, netns_unavailable_reason, parse_rate

RECIPES = Path(__file__).resolve().parents[1]


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The command-line interface; ``--help`` shows ``description``."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--nproc", type=int, default=2, help="number of ranks (processes), at least 2")
    add("--rates", default="unlimited,1gbit,100mbit", help="comma-separated tc tbf link rates; unlimited = no qdisc")
    add("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    add("--no-netns", dest="no_netns", action="store_true", help="run unthrottled on the host loopback")
    add("--netns_name", default="zo_bench", help="network namespace to create and delete")
    add("--tbf_burst", default="1mb", help="tc tbf burst")
    add("--tbf_latency", default="100ms", help="tc tbf latency (queue length in time)")
    add("--output_dir", default="outputs/benchmark", help="where JSON, markdown and PNGs go")
    add("--timeout", type=float, default=3600.0, help="seconds allowed for the whole run")
    add("--collective_timeout", type=float, default=300.0, help="gloo collective timeout in seconds")
    add("--log_every", type=int, default=10, help="rank 0 prints a progress line every N steps")
    add("--no_plots", action="store_true", help="skip the PNG plots")
    add("--corpus_chars", type=int, default=3_000_000, help="characters of the embedded corpus of recipes/pretrain.py")
    add("--layers", type=int, default=4, help="BertForMaskedLM: transformer layers")
    add("--hidden", type=int, default=256, help="hidden size")
    add("--heads", type=int, default=4, help="attention heads")
    add("--intermediate", type=int, default=1024, help="feed-forward size")
    add("--vocab", type=int, default=8192, help="vocabulary size of the byte-level BPE tokenizer")
    add("--seq_len", type=int, default=128, help="sequence length")
    add("--batch_size", type=int, default=8, help="sequences per rank per step")
    add("--seed", type=int, default=0, help="seed of the model, the data and dropout")
    add("--steps", type=int, default=40, help="optimizer steps per method")
    add("--nocomm_steps", type=int, default=10, help="steps of the no-communication reference")
    add("--skip_steps", type=int, default=3, help="first steps of each method left out of the timings")
    add("--lr", type=float, default=1e-3, help="peak learning rate (linear warm-up, then constant)")
    add("--weight_decay", type=float, default=0.01, help="decoupled weight decay")
    add("--warmup_steps", type=int, default=10, help="LR warm-up, 1-bit Adam freeze_step, PowerSGD start_powerSGD_iter")
    add("--zeroone_exact_warmup_steps", type=int, help="0/1 Adam exact_warmup_steps (default: the optimizer's)")
    add("--exact_step_dtype", choices=("float8_e4m3fn", "bfloat16", "float32"), default="float8_e4m3fn",
        help="precision of both optimizers' exact steps (default: the optimizers' own)")  # fmt: skip
    for name, default in ("var_freeze_step", 20), ("var_update_scaler", 2), ("local_step_scaler", 4):
        add(f"--{name}", type=int, default=default, help=f"0/1 Adam {name}")
    add("--local_step_clipper", type=int, default=4, help="0/1 Adam local_step_clipper")
    add("--powersgd_rank", type=int, default=4, help="PowerSGD matrix_approximation_rank")
    return p


def validate_args(args: argparse.Namespace) -> list[str]:
    """Exit with a message for inconsistent options; return the methods to run."""
    methods, most = [m for m in args.methods.split(",") if m], min(args.steps, args.nocomm_steps)
    for rate in args.rates.split(","):
        parse_rate(rate)
    for bad, message in [
        (not methods or any(m not in METHODS for m in methods), f"--methods: choose from {', '.join(METHODS)}"),
        (args.nproc < 2, "--nproc must be >= 2: a benchmark of communication needs two ranks"),
        (args.vocab < 300, "--vocab must be >= 300 (a byte-level BPE starts from 256 bytes)"),
        (not 0 <= args.skip_steps < most, f"--skip_steps must be in [0, {most}): below --steps and --nocomm_steps"),
    ]:
        if bad:
            raise SystemExit(message)
    return methods


def launch_ranks(cfg_path: Path, nproc: int, netns: NetNamespace | None, timeout: float) -> None:
    """Run ``torchrun -m bench.measure`` (inside ``netns`` if given); raise with the stderr tail on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = (netns.exec_prefix() if netns else []) + cmd + ["-m", "bench.measure", str(cfg_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RECIPES), str(RECIPES.parent), env.get("PYTHONPATH")]))
    log, code = cfg_path.with_name("ranks.log"), None
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stderr=err, start_new_session=True, cwd=RECIPES.parent)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:  # timed out, or the parent is being stopped: end torchrun and its ranks
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    if code != 0:
        why = f"timed out after {timeout:.0f} s" if code is None else f"torchrun exited with {code}"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        raise RuntimeError(f"benchmark ranks failed: {why}\n--- torchrun and rank stderr (tail) ---\n{tail}")


def steps_summary(rec: dict[str, Any], a: int, b: int, args: dict[str, Any]) -> dict[str, Any]:
    """Bytes, collectives and timings of steps ``[a, b)`` of one method record (bytes per rank per step)."""
    n, ranks, marks, world = b - a, rec["ranks"], rec["marks"], args["nproc"]
    wire = marks[str(b)]["tx_bytes"] - marks[str(a)]["tx_bytes"] if str(a) in marks and str(b) in marks else None
    acc, coll = sum(sum(r["acc_bytes"][a:b]) for r in ranks), ranks[0]["acc_coll"][a:b]  # acc: over all ranks
    timed = [s for s in range(a, b) if s >= args["skip_steps"]]
    step_max = [max(r["time_s"][s] for r in ranks) for s in timed]  # a step ends when its slowest rank does
    phase_time = max(sum(r["time_s"][s] for s in timed) for r in ranks) if timed else None
    return {
        "steps": n, "kinds": dict(Counter(rec["kinds"][a:b])), "wire_bytes_total": wire,
        "wire_bytes_per_step_per_rank": None if wire is None else wire / world / n,
        "accounted_bytes_per_step_per_rank": acc / world / n,
        "wire_over_accounted": (wire / acc) if (wire is not None and acc > 0) else None,
        "collectives_per_step": (sum(coll) / n) if all(c >= 0 for c in coll) else None,
        "median_step_ms": statistics.median(step_max) * 1e3 if step_max else None,
        "mean_step_ms": phase_time / len(timed) * 1e3 if timed else None,
        "samples_per_s": world * args["batch_size"] * len(timed) / phase_time if timed and phase_time else None,
    }  # fmt: skip


def summarize_method(rec: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Per-phase and whole-run numbers, the mean loss of the last tenth of the steps, and the plots' curves."""
    n, ranks, world = rec["steps"], rec["ranks"], args["nproc"]
    loss = [statistics.fmean(r["loss"][s] for r in ranks) for s in range(n)]
    wire, base = rec["wire_after_step"], rec["marks"].get("0", {}).get("tx_bytes")
    wire = [(x - base) / world for x in wire] if wire else None
    return {
        **{k: rec.get(k) for k in ("method", "label", "steps", "numel", "ddp_buckets", "wall_s")},
        "main_phase": rec["phases"][-1]["name"], "whole_run": steps_summary(rec, 0, n, args),
        "phases": {p["name"]: dict(steps_summary(rec, p["start"], p["end"], args), start=p["start"], end=p["end"])
                   for p in rec["phases"]},
        "loss_last_tenth": statistics.fmean(loss[-max(1, n // 10) :]),  # steadier than one step's loss
        "curves": {"loss": loss, "wire_bytes_cum_per_rank": wire,
                   "accounted_bytes_cum_per_rank": [sum(sum(r["acc_bytes"][: s + 1]) for r in ranks) / world
                                                    for s in range(n)]},
    }  # fmt: skip


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec)


def _bytes(x: float | None) -> str:
    if x is None:
        return "n/a"
    scale, unit = next((s, u) for s, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (0, "B")) if abs(x) >= s)
    return f"{x / scale:.3g} {unit}" if scale else f"{x:.0f} B"


def table_row(rate: str, m: dict[str, Any], fp32: dict[str, Any] | None) -> str:
    """One row of the results table; bytes of the main phase are wire bytes where measured."""
    w, main = m["whole_run"], m["phases"][m["main_phase"]]
    key = "wire_bytes_per_step_per_rank"  # wire bytes where measured
    key = "accounted_bytes_per_step_per_rank" if main[key] is None else key
    main_bytes, ref = main[key], fp32 and fp32["whole_run"][key]
    factor = f"{ref / main_bytes:.1f}" if ref and main_bytes else ("∞" if ref else "n/a")
    ms = [m["phases"].get(p, {}).get("median_step_ms") for p in ("warm-up", "compression", "local")]
    ms = [None, w["median_step_ms"], None] if m["main_phase"] == "all" else ms
    final = _fmt(m["loss_last_tenth"], ".3f")
    if m["method"] == "nocomm":  # it sends only a few barriers, and its replicas never synchronise
        factor, final = "–", "– (replicas never synchronise)"
    cells = [rate, m["label"], _bytes(w["wire_bytes_per_step_per_rank"]),
             _bytes(w["accounted_bytes_per_step_per_rank"]), _fmt(w["wire_over_accounted"], ".3f"),
             _bytes(main_bytes), factor, _fmt(w["collectives_per_step"], ".2f"),
             " / ".join("–" if x is None else f"{x:.0f}" for x in ms),
             f"{_fmt(w['samples_per_s'], '.1f')} / {_fmt(main['samples_per_s'], '.1f')}", final]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def render_markdown(report: dict[str, Any]) -> str:
    """The markdown report: setup, the results table and the link cross-check."""
    a, configs = report["args"], report["configs"]
    lines = [
        "# hf_zeroone communication benchmark", "", f"- command: `{report['command']}`", f"- link: {report['mode']}",
        f"- model: BertForMaskedLM, {a['layers']} layers, hidden {a['hidden']}, {report['numel'] / 1e6:.2f}M "
        f"parameters; {a['nproc']} ranks, gloo on CPU, 1 thread per rank; data: {report['data']}",
        "- options: " + ", ".join(f"{k} {v}" for k, v in a.items() if k not in ("methods", "rates", "output_dir")),
        f"- wall time: {report['wall_s']:.0f} s", "",
        "Bytes are per rank per step. *wire* = namespace loopback tx bytes / ranks (TCP/IP headers and ACKs "
        "included); *accounted* = the package's `CommStats.bytes_sent` for hf_zeroone methods, the expected ring "
        "bytes for torch's (fp32 / fp16 / PowerSGD P and Q). *main phase* = the phase a long run spends its steps "
        "in (DDP: all steps; 1-bit Adam and PowerSGD: compression; 0/1 Adam: local steps). Step times: median of "
        "the per-step maximum over ranks, per phase (warm-up / compression / local). samples/s over the timed steps.",
        "",
        "| link | method | wire B/step (run) | accounted B/step (run) | wire/acc | main-phase wire B/step | "
        "fp32 ÷ main | collectives/step (run) | step ms warm-up / compr. / local | samples/s run / main | "
        "mean loss, last 10% of steps |",
        "|" + "---|" * 2 + "---:|" * 9,
        *(table_row(c["rate"], m, c["methods"].get("ddp_fp32")) for c in configs for m in c["methods"].values()),
        "",
    ]  # fmt: skip
    for c in configs:  # everything the namespace sent against what the measured windows saw
        if c["netns_tx_bytes"] is not None:
            windows = sum(m["whole_run"]["wire_bytes_total"] or 0 for m in c["methods"].values())
            lines.append(f"- {c['rate']}: loopback tx {_bytes(c['netns_tx_bytes'])} in all, {_bytes(windows)} inside "
                         "the measured windows (the rest: start-up, DDP's initial broadcast, gathering results); "
                         f"wall {c['wall_s']:.0f} s")  # fmt: skip
    return "\n".join([*lines, ""])


def make_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """Throughput against link rate per method; loss against cumulative bytes per rank on the slowest link."""
    configs, rates = report["configs"], [c["rate"] for c in report["configs"]]
    with figure(out_dir / "throughput_vs_rate.png", 1, 2, figsize=(11, 4.2)) as (_, axes):
        for ax, title in zip(axes, ("whole run", "main phase")):
            for m in dict.fromkeys(m for c in configs for m in c["methods"]):
                runs = [c["methods"].get(m) for c in configs]
                parts = [s and (s["whole_run"] if title == "whole run" else s["phases"][s["main_phase"]]) for s in runs]
                ys = [float("nan") if not p or p["samples_per_s"] is None else p["samples_per_s"] for p in parts]
                ax.plot(range(len(rates)), ys, marker="o", label=METHODS[m])
            ax.set(xticks=range(len(rates)), xticklabels=rates, xlabel="link rate (tc tbf on the namespace loopback)",
                   ylabel="samples/s (all ranks)", title=f"throughput, {title}")  # fmt: skip
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7)
    slowest = min(configs, key=lambda c: parse_rate(c["rate"]))
    basis = "wire" if any(s["curves"]["wire_bytes_cum_per_rank"] for s in slowest["methods"].values()) else "accounted"
    with figure(out_dir / "loss_vs_bytes.png", figsize=(6.5, 4.2)) as (_, ax):
        for m, s in slowest["methods"].items():
            xs = s["curves"]["wire_bytes_cum_per_rank"] or s["curves"]["accounted_bytes_cum_per_rank"]
            pts = [(x, y) for x, y in zip(xs, s["curves"]["loss"]) if x > 0]
            if pts and m != "nocomm":
                ax.plot(*zip(*pts), marker=".", label=METHODS[m])
        ax.set(xscale="log", xlabel=f"cumulative {basis} bytes per rank (link {slowest['rate']})",
               ylabel="training loss (mean over ranks)", title="loss vs bytes sent")  # fmt: skip
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return ["throughput_vs_rate.png", "loss_vs_bytes.png"]


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    """Parse arguments, run every method on every link rate, write and print the report."""
    args = build_parser(description).parse_args(argv)
    methods, start, out = validate_args(args), time.perf_counter(), Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # end through the finally blocks: namespace deleted, ranks killed
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    netns, reason = None, "--no-netns given" if args.no_netns else netns_unavailable_reason()
    if reason is None:
        netns = NetNamespace(args.netns_name)
        try:
            netns.create()
        except RuntimeError as exc:
            netns.delete()
            netns, reason = None, f"could not create a network namespace: {exc}"
    mode = f"NO network namespace ({reason}): one unthrottled host loopback, --rates NOT applied, no wire bytes"
    if netns:
        mode = f"network namespace `{netns.name}`, loopback shaped by tc tbf (burst {args.tbf_burst}, latency "
        mode += f"{args.tbf_latency}), one qdisc shared by all ranks' traffic"
    print(f"link: {mode}" if netns else f"WARNING: {mode}. Only the accounted bytes are reported.", flush=True)
    rates = rates if netns else ["host-loopback"]
    try:
        with tempfile.TemporaryDirectory(prefix="zo_bench_") as tmp:
            cfg = dict(vars(args), methods=methods, rates=rates, in_netns=netns is not None)
            cfg["result_path"] = str(Path(tmp) / "raw.json")
            print("data: reading the embedded corpus and training the tokenizer", flush=True)
            cfg.update(prepare_text_blocks(cfg, Path(tmp)))
            (Path(tmp) / "config.json").write_text(json.dumps(cfg))
            launch_ranks(Path(tmp) / "config.json", args.nproc, netns, args.timeout)
            raw = json.loads(Path(cfg["result_path"]).read_text())
    finally:
        if netns is not None:
            netns.delete()
    (out / "raw.json").write_text(json.dumps(raw))
    configs = [dict(rec, methods={r["method"]: summarize_method(r, vars(args)) for r in rec["methods"]}) for rec in raw]
    report: dict[str, Any] = {
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv] if argv is None else argv),
        "mode": mode, "netns": netns is not None, "args": vars(args), "configs": configs,
        "numel": next(iter(configs[0]["methods"].values()))["numel"], "wall_s": time.perf_counter() - start,
        "data": f"the embedded corpus of recipes/pretrain.py ({cfg['text_chars'] / 1e6:.1f}M characters of "
        f"standard-library docstrings, {cfg['text_sequences']:,} sequences), byte-level BPE of {cfg['vocab']} tokens",
    }  # fmt: skip
    md = render_markdown(report)
    (out / "results.md").write_text(md)
    if not args.no_plots:
        report["plots"] = make_plots(report, out)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    print("\n" + md)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}" + ("" if args.no_plots else " and PNG plots"))
    return 0
