"""The benchmark's report: markdown (``results.md``, also printed) and two PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.measure import METHODS
from bench.netns import parse_rate


def _exact_warmup(a: dict) -> str:
    """0/1 Adam's exact steps as run (reports of runs before the flag existed: the LR warm-up)."""
    given = a.get("zeroone_exact_warmup_steps", a["warmup_steps"])
    return "all of phase 1" if given is None else str(given)


def _fmt_bytes(x: float | None) -> str:
    if x is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec)


def _fmt_qdisc(q: dict[str, Any] | None) -> str:
    if not q:
        return "no qdisc"
    return (
        f"tbf passed {_fmt_bytes(q.get('bytes'))} in {q.get('packets')} packets, {q.get('drops')} drops, "
        f"{q.get('overlimits')} overlimits"
    )


def render_markdown(report: dict[str, Any]) -> str:
    """The markdown report: setup, the main table, per-phase details, targets, pack/unpack."""
    a = report["args"]
    lines = ["# hf_zeroone communication benchmark", ""]
    lines.append(f"- command: `{report['command']}`")
    lines.append(f"- link: {report['mode']}")
    lines.append(
        f"- model: BertForMaskedLM, {a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads, "
        f"FFN {a['intermediate']}, vocab {a['vocab']} ({report['numel'] / 1e6:.2f}M parameters); seq {a['seq_len']}, "
        f"batch {a['batch_size']} per rank; {a['nproc']} ranks, gloo on CPU, 1 thread per rank"
    )
    lines.append(f"- data (`--data {a.get('data', 'synthetic')}`): {report.get('data', 'synthetic language')}")
    lines.append(
        f"- schedule: {a['steps']} steps (no-communication reference: {a['nocomm_steps']}), lr {a['lr']} with "
        f"{a['warmup_steps']} warm-up steps; exact steps in {a.get('exact_step_dtype', 'float32')}; "
        f"1-bit Adam freeze_step {a['warmup_steps']}; 0/1 Adam "
        f"exact_warmup_steps {_exact_warmup(a)}, "
        f"var_freeze_step {a['var_freeze_step']}, var_update_scaler "
        f"{a['var_update_scaler']}, local_step_scaler {a['local_step_scaler']}, local_step_clipper "
        f"{a['local_step_clipper']}; PowerSGD rank {a['powersgd_rank']}, start_powerSGD_iter "
        f"{max(2, a['warmup_steps'])}; timings leave out the first {a['skip_steps']} steps"
    )
    lines.append(f"- wall time: {report['wall_s']:.0f} s")
    lines.append("")
    lines.append(
        "Bytes are per rank per step. *wire* = namespace loopback tx bytes / ranks (TCP/IP headers and ACKs "
        "included); *accounted* = the package's `CommStats.bytes_sent` for hf_zeroone methods, the expected ring "
        "bytes for torch's (fp32 / fp16 / PowerSGD P and Q). *main phase* = the phase a long run spends its steps "
        "in (DDP: all steps; 1-bit Adam and PowerSGD: compression; 0/1 Adam: local steps). Step times: median of "
        "the per-step maximum over ranks, per phase (warm-up / compression / local). samples/s over the timed steps."
    )
    lines.append("")
    loss_steps = sorted(
        {
            int(s)
            for c in report["configs"]
            for m in c["methods"].values()
            if m["method"] != "nocomm"
            for s in m["loss_at"]
        }
    )
    head = (
        "| link | method | wire B/step (run) | accounted B/step (run) | wire/acc | main-phase wire B/step | "
        "fp32 ÷ main | collectives/step (run) | step ms warm-up / compr. / local | samples/s run / main | "
        f"loss @ {' / '.join(map(str, loss_steps))} | mean loss, last 10% of steps |"
    )
    lines += [head, "|" + "---|" * 2 + "---:|" * 10]
    for c in report["configs"]:
        fp32 = c["methods"].get("ddp_fp32")
        for m in c["methods"].values():
            w, main = m["whole_run"], m["phases"][m["main_phase"]]
            main_bytes = main["wire_bytes_per_step_per_rank"]
            if main_bytes is None:
                main_bytes = main["accounted_bytes_per_step_per_rank"]
            ref = None
            if fp32 is not None:
                ref = fp32["whole_run"]["wire_bytes_per_step_per_rank"]
                if ref is None or main["wire_bytes_per_step_per_rank"] is None:
                    ref = fp32["whole_run"]["accounted_bytes_per_step_per_rank"]
            factor = f"{ref / main_bytes:.1f}" if ref and main_bytes else ("∞" if ref else "n/a")
            if m["method"] == "nocomm":
                factor = "–"  # what it sends is a few barriers
            ms = [m["phases"].get(p, {}).get("median_step_ms") for p in ("warm-up", "compression", "local")]
            if m["main_phase"] == "all":
                ms = [None, w["median_step_ms"], None]
            step_ms = " / ".join("–" if x is None else f"{x:.0f}" for x in ms)
            losses = " / ".join(_fmt(m["loss_at"].get(str(s)), ".3f") for s in loss_steps)
            final = _fmt(m.get("loss_last_tenth"), ".3f")
            if m["method"] == "nocomm":
                losses, final = "– (replicas never synchronise)", "–"
            ratio = _fmt(w["wire_over_accounted"], ".3f")
            lines.append(
                f"| {c['rate']} | {m['label']} | {_fmt_bytes(w['wire_bytes_per_step_per_rank'])} | "
                f"{_fmt_bytes(w['accounted_bytes_per_step_per_rank'])} | {ratio} | {_fmt_bytes(main_bytes)} | "
                f"{factor} | {_fmt(w['collectives_per_step'], '.2f')} | {step_ms} | "
                f"{_fmt(w['samples_per_s'], '.1f')} / {_fmt(main['samples_per_s'], '.1f')} | {losses} | {final} |"
            )
    lines += ["", "## Targets (goals from the issue, not asserts)", ""]
    lines += [f"- **{t['status']}** {t['text']}" for t in report["targets"]]
    lines += ["", "## Phases", ""]
    lines.append(
        "| link | method | phase | steps | step kinds | wire B/step | accounted B/step | wire/acc | TCP retrans. | "
        "collectives/step | median step ms | mean step ms | samples/s |"
    )
    lines.append("|---|---|---|---:|---|" + "---:|" * 8)
    for c in report["configs"]:
        for m in c["methods"].values():
            for name, ph in m["phases"].items():
                kinds = ", ".join(f"{k} ×{v}" for k, v in ph["kinds"].items())
                lines.append(
                    f"| {c['rate']} | {m['method']} | {name} [{ph['start']}, {ph['end']}) | {ph['steps']} | {kinds} | "
                    f"{_fmt_bytes(ph['wire_bytes_per_step_per_rank'])} | "
                    f"{_fmt_bytes(ph['accounted_bytes_per_step_per_rank'])} | "
                    f"{_fmt(ph['wire_over_accounted'], '.3f')} | "
                    f"{_fmt(ph['tcp_retransmissions'], 'd')} | {_fmt(ph['collectives_per_step'], '.2f')} | "
                    f"{_fmt(ph['median_step_ms'], '.0f')} | {_fmt(ph['mean_step_ms'], '.0f')} | "
                    f"{_fmt(ph['samples_per_s'], '.1f')} |"
                )
    lines += ["", "## Link cross-check", ""]
    if report.get("netns_tx_bytes_run") is not None:
        lines.append(
            f"- whole run: `ip -n NS -s -j link show lo` tx {_fmt_bytes(report['netns_tx_bytes_run'])} "
            "(torchrun's rendezvous and start-up included)"
        )
    for c in report["configs"]:
        ns = c.get("netns_tx_bytes")
        windows = sum(m["whole_run"]["wire_bytes_total"] or 0 for m in c["methods"].values())
        if ns is None:
            lines.append(f"- {c['rate']}: wire bytes not measured ({report['mode']})")
        else:
            lines.append(
                f"- {c['rate']}: loopback tx over the whole configuration (rank 0, /proc/net/dev) {_fmt_bytes(ns)}; "
                f"inside the measured windows {_fmt_bytes(windows)} (the rest: start-up, rendezvous, DDP's initial "
                f"broadcast, process-group creation, result gathering); {_fmt_qdisc(c.get('qdisc'))}; "
                f"wall {c['wall_s']:.0f} s"
            )
    p = report["pack_unpack"]
    lines += [
        "",
        f"Sign compression on one thread ({p['numel']:,} fp32): pack {p['pack_ms']:.2f} ms ({p['pack_gbps']:.2f} "
        f"GB/s), unpack {p['unpack_ms']:.2f} ms ({p['unpack_gbps']:.2f} GB/s), pack+unpack "
        f"{p['pack_unpack_gbps']:.2f} GB/s of fp32 input.",
        "",
    ]
    return "\n".join(lines)


def make_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """Throughput vs link rate per method; loss vs cumulative bytes per rank (slowest link). Returns file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = report["configs"]
    methods = list(dict.fromkeys(m for c in configs for m in c["methods"]))
    rates = [c["rate"] for c in configs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, which, title in ((axes[0], "whole_run", "whole run"), (axes[1], "main", "main phase")):
        for m in methods:
            ys = []
            for c in configs:
                s = c["methods"].get(m)
                if s is None:
                    ys.append(float("nan"))
                    continue
                ph = s["whole_run"] if which == "whole_run" else s["phases"][s["main_phase"]]
                ys.append(ph["samples_per_s"] if ph["samples_per_s"] is not None else float("nan"))
            ax.plot(range(len(rates)), ys, marker="o", label=METHODS[m])
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("link rate (tc tbf on the namespace loopback)")
        ax.set_ylabel("samples/s (all ranks)")
        ax.set_title(f"throughput, {title}")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    files = ["throughput_vs_rate.png"]
    fig.savefig(out_dir / files[0], dpi=110)
    plt.close(fig)

    slowest = min(configs, key=lambda c: parse_rate(c["rate"]))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    basis = "accounted"
    for m, s in slowest["methods"].items():
        if m == "nocomm":
            continue
        curves = s["curves"]
        xs = curves["wire_bytes_cum_per_rank"] or curves["accounted_bytes_cum_per_rank"]
        if curves["wire_bytes_cum_per_rank"]:
            basis = "wire"
        pts = [(x, y) for x, y in zip(xs, curves["loss"]) if x > 0]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=".", label=METHODS[m])
    ax.set_xscale("log")
    ax.set_xlabel(f"cumulative {basis} bytes per rank (link {slowest['rate']})")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title("loss vs bytes sent")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append("loss_vs_bytes.png")
    fig.savefig(out_dir / files[1], dpi=110)
    plt.close(fig)
    return files
