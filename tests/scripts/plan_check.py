#!/usr/bin/env python
"""The planner (``python -m hf_zeroone.plan``) against measured runs on a rate-limited link.

    sudo python tests/scripts/plan_check.py                        # benchmark at 1gbit, 300mbit, 100mbit, then compare
    python tests/scripts/plan_check.py --results outputs/plan_check  # compare with a benchmark run already made
    sudo python tests/scripts/plan_check.py --rates 100mbit -- --steps 20   # after --: flags of benchmark.py

Runs ``recipes/benchmark.py`` (2 ranks, one core each, DDP fp32, 1-bit Adam and 0/1 Adam with the
hf_zeroone hook) on a network namespace whose loopback is shaped to each rate, then measures the
planner's inputs for the same model here, in one process (three times: each input's fastest
counts, the least disturbed on a shared machine), and projects each run's step: the
measured steps' kinds, weighted as the run took them, on one shared medium of that rate (the
namespace's single token bucket) without overlap (one core per rank). Prints predicted against
measured mean step times and their error; the planner's goal is within 20%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
sys.path.insert(0, str(RECIPES))

from bench.measure import build_model  # noqa: E402
from bench.netns import parse_rate  # noqa: E402

from hf_zeroone.optim import StepKind  # noqa: E402
from hf_zeroone.plan import Cluster, Measurements, measure  # noqa: E402
from hf_zeroone.plan._project import compressed_step, ddp_step  # noqa: E402

METHODS = {"ddp_fp32": "DDP fp32", "onebit": "1-bit Adam", "zeroone": "0/1 Adam"}


def measured_kinds(record: dict, skip: int) -> dict[str, float]:
    """Per step kind of a benchmark run: the median over its steps of the slowest rank's seconds."""
    times: dict[str, list[float]] = {}
    slowest = [max(ts) for ts in zip(*(r["time_s"] for r in record["ranks"]))]
    for kind, t in list(zip(record["kinds"], slowest))[skip:]:
        times.setdefault(kind, []).append(t)
    return {kind: statistics.median(ts) for kind, ts in times.items()}


def fastest(rounds: list[Measurements]) -> Measurements:
    """Each input's fastest measurement over the rounds: on a shared machine, the least disturbed one."""
    m = rounds[0]
    for key in ("forward", "backward", "adamw_step", "powersgd_seconds"):
        setattr(m, key, min(getattr(r, key) for r in rounds))
    for name, kinds in m.kinds.items():
        for kind, cost in kinds.items():
            cost.seconds = min(r.kinds[name][kind].seconds for r in rounds)
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="outputs/plan_check", help="benchmark output folder (made if absent)")
    parser.add_argument("--rates", default="1gbit,300mbit,100mbit")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of the planner's measurements")
    parser.add_argument("--rounds", type=int, default=3, help="measure this many times; each input's fastest counts")
    argv = sys.argv[1:]
    forwarded = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    out = Path(args.results)
    if not (out / "raw.json").exists():
        cmd = [sys.executable, str(RECIPES / "benchmark.py"), "--rates", args.rates, "--methods",
               ",".join(METHODS), "--no_plots", "--output_dir", str(out), *forwarded]  # fmt: skip
        subprocess.run(cmd, check=True)
    report = json.loads((out / "results.json").read_text())
    if not report["netns"]:
        raise SystemExit("the benchmark ran without a shaped link (it needs root, ip and tc): nothing to compare")
    raw, cfg = json.loads((out / "raw.json").read_text()), report["args"]
    torch.set_num_threads(1)  # as each rank of the benchmark
    model = build_model(dict(cfg, vocab=cfg["vocab"], seed=0))
    numel = sum(p.numel() for p in model.parameters())
    if numel != report["numel"]:
        raise SystemExit(f"the rebuilt model has {numel:,} parameters, the benchmark's {report['numel']:,}")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch_size"], cfg["seq_len"]), generator=gen)
    m = fastest([measure(model, {"input_ids": ids, "labels": ids}, cfg["nproc"], repeats=args.repeats)
                 for _ in range(args.rounds)])  # fmt: skip
    kinds = "; ".join(f"{n} {k.value} {1e3 * c.seconds:.0f} ms" for n, ks in m.kinds.items() for k, c in ks.items())
    print(f"measured here: forward {1e3 * m.forward:.0f} ms, backward {1e3 * m.backward:.0f} ms, "
          f"AdamW {1e3 * m.adamw_step:.1f} ms; step() by kind: {kinds}")  # fmt: skip
    print(
        "\n| link | method | steps by kind | B/step projected | B/step counted | predicted ms | measured ms | error |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    worst = 0.0
    for rec in raw:
        rate = parse_rate(rec["rate"])
        cluster = Cluster(1, cfg["nproc"], rate, rate, 0.0, 0.0, shared=True, overlap=False)
        for run in rec["methods"]:
            medians = measured_kinds(run, cfg["skip_steps"])
            counts = Counter(run["kinds"][cfg["skip_steps"] :])
            measured = sum(n * medians[k] for k, n in counts.items()) / sum(counts.values())
            if run["method"] == "ddp_fp32":
                predicted, sent = ddp_step(cluster, m, 4)
            else:
                kinds = {StepKind(k): n for k, n in counts.items()}
                predicted, sent = compressed_step(cluster, m, METHODS[run["method"]], kinds)
            counted = statistics.mean(run["ranks"][0]["acc_bytes"][cfg["skip_steps"] :])
            error = predicted / measured - 1
            worst = max(worst, abs(error))
            mix = ", ".join(f"{k} {n}" for k, n in counts.items())
            print(f"| {rec['rate']} | {METHODS[run['method']]} | {mix} | {sent:,.0f} | {counted:,.0f} | "
                  f"{1e3 * predicted:.0f} | {1e3 * measured:.0f} | {100 * error:+.1f}% |")  # fmt: skip
    print(f"\nlargest error {100 * worst:.1f}% (goal: at most 20%)")


if __name__ == "__main__":
    main()
