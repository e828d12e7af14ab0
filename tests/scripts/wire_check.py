#!/usr/bin/env python
"""The suite's byte counts against the wire: every rank of a run in one network namespace (as root).

    sudo python tests/scripts/wire_check.py

Runs AdamW, torchft DiLoCo (H=8), DeMo (top-k 8), post-local SGD (period 4), 1-bit Adam and 0/1
Adam (with their defaults, float8 exact steps, and with bf16 exact steps) on the quick CLM workload
of ``recipes/frontier.py``, each in a fresh network namespace of its own (``recipes/bench/netns.py``), and
compares what the suite counted (bytes each rank sent, summed over ranks) with the bytes the
namespace's loopback carried. The wire carries more than training traffic: TCP/IP headers, the
rendezvous, DDP's initial broadcast, the replica check after the loop and, for DiLoCo, the
lighthouse's quorums. Those are the same whatever the run's length, so each method runs twice, for
40 and for 80 steps, and the check compares the differences: the bytes the 40 extra steps put on
the wire against the bytes the suite counted for them. A count that missed a collective shows as a
ratio well above 1; one that counted bytes never sent, below 1. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))  # the suite it checks

from bench.netns import NetNamespace, netns_unavailable_reason  # noqa: E402 - needs the path
from convergence import make_spec, prepare_lm_data  # noqa: E402
from frontier import FrontierArguments, suite_arguments  # noqa: E402
from suite.launch import launch  # noqa: E402

POINTS = [
    ("AdamW", "adamw", {}),
    ("DiLoCo H=8", "diloco", {"sync_every": 8}),
    ("DeMo top-k 8", "demo", {"compression_top_k": 8}),
    ("post-local SGD period 4", "post_local_sgd", {"period": 4}),
    ("1-bit Adam", "onebit_adam", {}),  # exact steps as float8 messages, the default
    ("0/1 Adam", "zeroone_adam", {}),
    ("1-bit Adam bf16", "onebit_adam", {"exact_step_dtype": "bfloat16"}),
    ("0/1 Adam bf16", "zeroone_adam", {"exact_step_dtype": "bfloat16"}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=None, help="Run directories (default: a temporary one).")
    labels = ", ".join(label for label, _, _ in POINTS)
    parser.add_argument("--points", default=None, help=f"Comma-separated labels to run (default: all of {labels}).")
    args = parser.parse_args()
    points = POINTS
    if args.points:
        wanted = [w.strip() for w in args.points.split(",") if w.strip()]
        unknown = sorted(set(wanted) - {label for label, _, _ in POINTS})
        if unknown:
            raise SystemExit(f"--points: unknown {unknown}; the points are: {labels}")
        points = [p for p in POINTS if p[0] in wanted]
    why = netns_unavailable_reason()
    if why:
        raise SystemExit(f"wire_check.py needs network namespaces: {why}")
    from tqdm.auto import tqdm

    out = Path(args.output_dir or tempfile.mkdtemp(prefix="wire_check_"))
    suite = suite_arguments(FrontierArguments(quick=True, output_dir=str(out)))
    data = prepare_lm_data(suite, out)
    lines = [
        "| method | counted, 40 steps | wire, 40 steps | counted, 80 steps | wire, 80 steps "
        "| extra wire / extra counted |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, method, settings in points:
        counted, wire = [], []
        for steps in (40, 80):
            run_dir = out / f"{label.replace(' ', '_').replace('/', '')}_{steps}"
            spec = make_spec(suite, "clm", method, data, run_dir, 0, steps)
            spec.update(settings=settings, warmup_steps=4)  # the same warm-up, so the extra steps are alike
            ns = NetNamespace(f"hfz_wire_{method}")
            ns.create()
            try:
                before = ns.lo_tx_bytes()
                with tqdm(desc=f"{label}, {steps} steps", unit="step") as bar:
                    result = launch(spec, suite.nproc, suite.timeout, bar, prefix=ns.exec_prefix())
                wire.append(ns.lo_tx_bytes() - before)
            finally:
                ns.delete()
            if "error" in result:
                raise SystemExit(f"{label} failed ({result['error']}):\n{result['log_tail']}")
            counted.append(result["bytes"] * suite.nproc)
        ratio = (wire[1] - wire[0]) / (counted[1] - counted[0])
        lines.append(f"| {label} | {counted[0]:,} | {wire[0]:,} | {counted[1]:,} | {wire[1]:,} | {ratio:.3f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
