"""``python -m hf_zeroone.plan``: project each method's step time on a cluster from measurements made here."""

from __future__ import annotations

import argparse
import sys

import torch

from hf_zeroone.plan import (
    PRESETS,
    Cluster,
    break_even_rate,
    build_model,
    format_rate,
    format_table,
    measure,
    parse_latency,
    parse_rate,
    project,
    random_batch,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_zeroone.plan", description=__doc__)
    add = p.add_argument
    add("--model", default="bert-base", help=f"one of {', '.join(PRESETS)}, or the path of a config.json")
    add("--batch-size", type=int, default=32, help="sequences per device per step")
    add("--seq-len", type=int, default=128, help="tokens per sequence")
    add("--nodes", type=int, default=2, help="nodes of the cluster")
    add("--gpus-per-node", type=int, default=1, help="ranks per node")
    add("--inter-rate", default="10gbit", help="each node's link to the others, e.g. 40gbit, 100gbit")
    add("--intra-rate", default=None, help="between ranks of a node, e.g. 2400gbit for NVLink (default: --inter-rate)")
    add("--inter-latency", default="20us", help="latency between nodes")
    add("--intra-latency", default="5us", help="latency inside a node")
    add("--shared-link", action="store_true", help="one medium carries every rank's traffic (a hub, a shaped loopback)")
    add("--steps", type=int, default=100_000, help="optimizer steps of the run (it sets the optimizers' schedules)")
    add("--warmup-steps", type=int, default=None, help="LR warm-up steps (default: 1%% of --steps)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to measure")
    add("--repeats", type=int, default=3, help="timed repeats of each measurement (medians)")
    add("--plot", default=None, metavar="PNG", help="also plot the speed-up against the rate between nodes")
    return p


def _progress(stages: int):  # noqa: ANN202 - a callable taking a stage name
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda stage: print(f"measuring: {stage}", file=sys.stderr, flush=True)
    bar = tqdm(total=stages, desc="measuring", file=sys.stderr, leave=False)

    def say(stage: str) -> None:
        if bar.n or stage != "forward and backward":
            bar.update(1)
        bar.set_postfix_str(stage)
        if bar.n == stages - 1:
            bar.close()

    return say


def _plot(m, cluster: Cluster, steps: int, warmup: int, path: str) -> None:  # noqa: ANN001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [10 ** (6 + k / 8) for k in range(8 * 6 + 1)]  # 1 Mbit/s .. 1 Tbit/s
    curves: dict[str, list[float]] = {}
    for rate in rates:
        for row in project(m, cluster.with_inter_rate(rate), steps, warmup):
            curves.setdefault(row.method, []).append(row.speedup)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in curves.items():
        ax.plot([r / 1e9 for r in rates], ys, label=name)
    ax.set(xscale="log", yscale="log", xlabel="rate between nodes (Gbit/s)", ylabel="speed-up over DDP fp32",
           title=f"{cluster.nodes} x {cluster.gpus_per_node} ranks, measured on {m.device}")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        inter = parse_rate(args.inter_rate)
        intra = parse_rate(args.intra_rate) if args.intra_rate else inter
        cluster = Cluster(args.nodes, args.gpus_per_node, inter, intra, parse_latency(args.inter_latency),
                          parse_latency(args.intra_latency), shared=args.shared_link,
                          overlap=torch.device(args.device).type == "cuda")  # fmt: skip
        if args.batch_size < 1 or args.seq_len < 1 or args.steps < 1 or args.repeats < 1:
            raise ValueError("--batch-size, --seq-len, --steps and --repeats must be at least 1")
        model = build_model(args.model, args.device)
        batch = random_batch(model, args.batch_size, args.seq_len)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    warmup = args.steps // 100 if args.warmup_steps is None else args.warmup_steps
    m = measure(model, batch, cluster.ranks, repeats=args.repeats, progress=_progress(6 if cluster.ranks > 1 else 4))
    print(f"model {args.model}: {m.parameters:,} parameters in {m.tensors} tensors; batch {args.batch_size} x "
          f"{args.seq_len} per rank; measured on {m.device}")  # fmt: skip
    print(f"cluster: {cluster.nodes} node(s) x {cluster.gpus_per_node} rank(s), {format_rate(inter)} between "
          f"nodes{' (one shared medium)' if cluster.shared else ''}, {format_rate(intra)} inside; "
          f"communication {'overlaps' if cluster.overlap else 'does not overlap'} backward")  # fmt: skip
    print(f"measured: forward {1e3 * m.forward:.1f} ms, backward {1e3 * m.backward:.1f} ms, "
          f"AdamW step {1e3 * m.adamw_step:.1f} ms, PowerSGD arithmetic {1e3 * m.powersgd_seconds:.1f} ms")  # fmt: skip
    for name, kinds in m.kinds.items():
        parts = [f"{k.value} {1e3 * c.seconds:.1f} ms / {c.bytes_sent:,} B" for k, c in kinds.items()]
        print(f"  {name} step() by kind: " + ", ".join(parts))
    print(f"\nProjected mean step over a run of {args.steps:,} steps ({warmup:,} of LR warm-up):\n")
    print(format_table(m, cluster, args.steps, warmup))
    if args.plot:
        _plot(m, cluster, args.steps, warmup, args.plot)
        print(f"\nplot: {args.plot}")
    if cluster.ranks > 1:
        even = break_even_rate(m, cluster, "1-bit Adam + hook", args.steps, warmup)
        print(f"\n1-bit Adam is faster than DDP fp32 below {format_rate(even)} between nodes.")


if __name__ == "__main__":
    main()
