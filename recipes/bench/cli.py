"""Command line and parent process of the communication benchmark (see ``recipes/benchmark.py``).

The parent makes the link (:mod:`bench.netns`), prepares the data once (:mod:`bench.workload`), starts the
ranks with ``torchrun`` -- inside the namespace: ``ip netns exec NS python -m torch.distributed.run
--standalone --nproc_per_node P -m bench.measure CONFIG.json`` -- shows their progress, and turns their raw
records into the report (:mod:`bench.analysis`, :mod:`bench.report`). The namespace is deleted at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.analysis import evaluate_targets, summarize_method
from bench.measure import DEFAULT_METHODS, METHODS, bench_pack_unpack
from bench.netns import NetNamespace, netns_unavailable_reason, parse_rate
from bench.report import make_plots, render_markdown
from bench.workload import DATA_CHOICES, FIRST_WORD_ID, describe, prepare_text_blocks

RECIPES = Path(__file__).resolve().parents[1]
REPO_ROOT = RECIPES.parent


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The command-line interface (every option has help text; ``--help`` shows ``description``)."""
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=description or __doc__, formatter_class=raw)
    run = p.add_argument_group("run")
    run.add_argument("--nproc", type=int, default=2, help="number of ranks (processes) per configuration")
    run.add_argument(
        "--rates",
        default="unlimited,1gbit,100mbit",
        help="comma-separated link rates for tc tbf (e.g. 1gbit, 100mbit, 500mbit); 'unlimited' = no qdisc",
    )
    run.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help=f"comma-separated subset of {', '.join(METHODS)} (nocomm times a step that sends nothing)",
    )
    run.add_argument("--no-netns", dest="no_netns", action="store_true", help="run unthrottled on host loopback")
    run.add_argument("--netns_name", default="zo_bench", help="name of the network namespace to create and delete")
    run.add_argument("--tbf_burst", default="1mb", help="tc tbf burst")
    run.add_argument("--tbf_latency", default="100ms", help="tc tbf latency (queue length in time)")
    run.add_argument("--output_dir", default="outputs/benchmark", help="where JSON, markdown and PNGs go")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for the whole run (all rates)")
    run.add_argument("--collective_timeout", type=float, default=300.0, help="gloo collective timeout in seconds")
    run.add_argument("--log_every", type=int, default=10, help="rank 0 prints a progress line every N steps")
    run.add_argument("--pack_numel", type=int, default=1 << 22, help="fp32 elements for the pack/unpack timing")
    run.add_argument("--pack_reps", type=int, default=10, help="repetitions of the pack/unpack timing")
    run.add_argument("--no_plots", action="store_true", help="skip the PNG plots")

    model = p.add_argument_group("model and data (BertForMaskedLM from a BertConfig)")
    model.add_argument(
        "--data",
        choices=DATA_CHOICES,
        default="text",
        help="text: the embedded corpus of recipes/pretrain.py with a BPE tokenizer of --vocab tokens; synthetic: "
        "4-successor token language (the data of the figures measured before text became the default)",
    )
    model.add_argument(
        "--corpus_chars", type=int, default=3_000_000, help="--data text: characters of the corpus to read"
    )
    model.add_argument("--layers", type=int, default=4, help="transformer layers")
    model.add_argument("--hidden", type=int, default=256, help="hidden size")
    model.add_argument("--heads", type=int, default=4, help="attention heads")
    model.add_argument("--intermediate", type=int, default=1024, help="feed-forward size")
    model.add_argument("--vocab", type=int, default=8192, help="vocabulary size (--data text: the tokenizer's)")
    model.add_argument("--seq_len", type=int, default=128, help="sequence length")
    model.add_argument("--batch_size", type=int, default=8, help="sequences per rank per step")
    model.add_argument("--seed", type=int, default=0, help="seed of the model, the data and dropout")

    sched = p.add_argument_group("schedule (the same for every method)")
    sched.add_argument("--steps", type=int, default=40, help="optimizer steps per method")
    sched.add_argument("--nocomm_steps", type=int, default=10, help="steps of the no-communication reference")
    sched.add_argument("--skip_steps", type=int, default=3, help="first steps of each method left out of the timings")
    sched.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (linear warm-up, then constant)")
    sched.add_argument("--weight_decay", type=float, default=0.01, help="decoupled weight decay")
    sched.add_argument(
        "--warmup_steps",
        type=int,
        default=10,
        help="LR warm-up; also 1-bit Adam freeze_step and PowerSGD start_powerSGD_iter",
    )
    sched.add_argument(
        "--zeroone_exact_warmup_steps",
        type=int,
        default=None,
        help="0/1 Adam exact_warmup_steps (default: the optimizer's, every step before its variance freeze; 0 is "
        "the paper's and DeepSpeed's schedule, with no exact steps beyond the variance steps)",
    )
    sched.add_argument(
        "--exact_step_dtype",
        choices=("float8_e4m3fn", "bfloat16", "float32"),
        default="float8_e4m3fn",
        help="precision of both optimizers' exact steps (default: theirs, float8_e4m3fn, block-scaled float8 "
        "messages; bfloat16: one collective where float8 makes two; float32 is the papers')",
    )
    sched.add_argument("--var_freeze_step", type=int, default=20, help="0/1 Adam: first local-step phase step")
    sched.add_argument("--var_update_scaler", type=int, default=2, help="0/1 Adam: var_update_scaler")
    sched.add_argument("--local_step_scaler", type=int, default=4, help="0/1 Adam: local_step_scaler")
    sched.add_argument("--local_step_clipper", type=int, default=4, help="0/1 Adam: local_step_clipper")
    sched.add_argument("--powersgd_rank", type=int, default=4, help="PowerSGD matrix_approximation_rank")
    sched.add_argument(
        "--loss_at", default="10,20,30,40", help="report the loss after these step counts (clipped to --steps)"
    )
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Raise ``SystemExit`` with a clear message for inconsistent options."""
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"--methods: unknown {unknown or 'empty list'}; choose from {', '.join(METHODS)}")
    for name in ("nproc", "steps", "nocomm_steps", "batch_size", "seq_len", "layers", "hidden", "heads", "vocab"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.nproc < 2:
        raise SystemExit("--nproc must be >= 2: a benchmark of communication needs at least two ranks")
    if args.hidden % args.heads:
        raise SystemExit(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    if args.vocab <= FIRST_WORD_ID + 4:
        raise SystemExit(f"--vocab must be > {FIRST_WORD_ID + 4}")
    if args.data == "text" and args.vocab < 300:
        raise SystemExit("--vocab must be >= 300 with --data text (a byte-level BPE starts from 256 bytes)")
    if args.zeroone_exact_warmup_steps is not None and args.zeroone_exact_warmup_steps < 0:
        raise SystemExit("--zeroone_exact_warmup_steps must be >= 0")
    if "powersgd" in methods and args.warmup_steps < 2:
        raise SystemExit("--warmup_steps must be >= 2 with powersgd (start_powerSGD_iter > 1 is required)")
    if args.skip_steps < 0 or args.skip_steps >= min(args.steps, args.nocomm_steps):
        raise SystemExit("--skip_steps must be >= 0 and smaller than --steps and --nocomm_steps")
    for rate in args.rates.split(","):
        parse_rate(rate)


def _progress(total: int) -> Any:
    try:
        if not sys.stderr.isatty():
            raise ImportError("no terminal: plain progress lines read better in a log")
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="configurations x methods", unit="run", file=sys.stderr)
    except ImportError:

        class _Plain:
            def __init__(self) -> None:
                self.n = 0

            def update(self, k: int = 1) -> None:
                self.n += k
                print(f"progress: {self.n}/{total} method runs done", flush=True)

            def write(self, msg: str) -> None:
                print(msg, flush=True)

            def close(self) -> None:
                pass

        return _Plain()


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def launch_ranks(cfg_path: Path, nproc: int, netns: NetNamespace | None, log: Path, timeout: float, bar: Any) -> None:
    """Run ``torchrun`` (inside ``netns`` if given) and show rank 0's progress; raise with the log tail on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "bench.measure", str(cfg_path)]
    if netns is not None:
        cmd = netns.exec_prefix() + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RECIPES), str(REPO_ROOT), env.get("PYTHONPATH")]))
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True, cwd=REPO_ROOT,
        )  # fmt: skip

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith("@@done"):
                    bar.update(1)
                elif line.startswith("@@rate_start "):
                    bar.write(f"== link {line.split(maxsplit=1)[1]}")
                else:
                    bar.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:  # timed out, or the parent is being stopped: end torchrun and its ranks
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        reader.join(timeout=10)
    if code != 0:
        why = f"timed out after {timeout:.0f} s" if code is None else f"torchrun exited with {code}"
        raise RuntimeError(f"benchmark ranks failed: {why}\n--- torchrun and rank stderr (tail) ---\n{_tail(log)}")


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    """Parse arguments and run the whole benchmark."""
    args = build_parser(description).parse_args(argv)
    validate_args(args)
    start = time.perf_counter()
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]) if argv is None else shlex.join(argv)

    # SIGTERM / SIGHUP end the run through the finally blocks (namespace deleted, ranks killed).
    def _terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)

    reason = "--no-netns given" if args.no_netns else netns_unavailable_reason()
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    netns: NetNamespace | None = None
    if reason is None:
        netns = NetNamespace(args.netns_name)
        try:
            netns.create()
        except RuntimeError as exc:
            netns.delete()
            netns, reason = None, f"could not create a network namespace: {exc}"
    if netns is None:
        mode = (
            f"NO network namespace ({reason}): unthrottled host loopback, link rates NOT applied, "
            "wire bytes NOT measured"
        )
        print(f"WARNING: {mode}. Only the accounted bytes are reported.", flush=True)
        if any(not math.isinf(parse_rate(r)) for r in rates):
            print(f"WARNING: --rates {args.rates} ignored; running one unthrottled configuration.", flush=True)
        rates = ["host-loopback"]
    else:
        mode = (
            f"network namespace `{netns.name}`, loopback shaped by tc tbf (burst {args.tbf_burst}, latency "
            f"{args.tbf_latency}), one qdisc shared by all ranks' traffic"
        )
        print(f"link: {mode}", flush=True)

    pack = bench_pack_unpack(args.pack_numel, args.pack_reps)
    print(f"pack+unpack on one thread: {pack['pack_unpack_gbps']:.2f} GB/s of fp32 input", flush=True)
    methods = [m for m in args.methods.split(",") if m]
    bar = _progress(len(rates) * len(methods))
    try:
        with tempfile.TemporaryDirectory(prefix="zo_bench_") as tmp:
            cfg = dict(vars(args), rates=rates, in_netns=netns is not None, result_path=str(Path(tmp) / "raw.json"))
            if args.data == "text":
                print("data: reading the embedded corpus and training the tokenizer", flush=True)
                cfg.update(prepare_text_blocks(cfg, Path(tmp)))
            cfg_path = Path(tmp) / "config.json"
            cfg_path.write_text(json.dumps(cfg))
            tx_before = netns.lo_tx_bytes() if netns is not None else None
            launch_ranks(cfg_path, args.nproc, netns, Path(tmp) / "ranks.log", args.timeout, bar)
            tx_run = netns.lo_tx_bytes() - tx_before if netns is not None else None
            raw = json.loads(Path(cfg["result_path"]).read_text())
    finally:
        bar.close()
        if netns is not None:
            netns.delete()
    (out_dir / "raw.json").write_text(json.dumps(raw))
    configs: list[dict[str, Any]] = []
    for rec in raw:
        configs.append(
            {
                "rate": rec["rate"],
                "wall_s": rec["wall_s"],
                "netns_tx_bytes": rec["netns_tx_bytes"],
                "qdisc": rec["qdisc"],
                "rate_bits_per_s": None if rec["rate"] == "host-loopback" else parse_rate(rec["rate"]),
                "netns": netns is not None,
                "methods": {r["method"]: summarize_method(r, vars(args)) for r in rec["methods"]},
            }
        )
    numel = next(iter(configs[0]["methods"].values()))["numel"]
    data_keys = ("vocab", "mask_id", "text_sequences", "text_chars")
    report: dict[str, Any] = {
        "command": command,
        "mode": mode,
        "netns": netns is not None,
        "netns_name": args.netns_name if netns is not None else None,
        "netns_tx_bytes_run": tx_run,
        "data": describe(cfg),
        "data_info": {k: cfg[k] for k in data_keys if k in cfg and args.data == "text"},
        "args": dict(vars(args)),
        "numel": numel,
        "pack_unpack": pack,
        "configs": configs,
        "wall_s": time.perf_counter() - start,
    }
    report["targets"] = evaluate_targets(configs, pack, wire_measured=netns is not None)
    md = render_markdown(report)
    (out_dir / "results.json").write_text(json.dumps(report, indent=1))
    (out_dir / "results.md").write_text(md)
    if not args.no_plots:
        report["plots"] = make_plots(report, out_dir)
        (out_dir / "results.json").write_text(json.dumps(report, indent=1))
    print("\n" + md)
    print(f"wrote {out_dir / 'results.json'}, {out_dir / 'results.md'}" + ("" if args.no_plots else " and PNG plots"))
    return 0
