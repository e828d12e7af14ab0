"""Projected step times of each method on a cluster, from :class:`~._measure.Measurements`.

A step is forward + backward + the optimizer's ``step()`` + the communication that does not hide
behind backward. Communication during backward (DDP's allreduce, the hf_zeroone hook's exact and
1-bit messages) overlaps it when the cluster overlaps (a GPU's communication stream): what shows
is the part longer than backward, and at least the last bucket's share. Communication in
``step()`` (0/1 Adam's syncs, DiLoCo's outer steps) always shows. The compression arithmetic
is counted in full, in ``step()``'s measured time.

hf_zeroone's optimizers change kind along a run; their projection is the mean over the run's
steps, weighted by how many steps of each kind their default schedule takes
(:func:`~._measure.step_kind_counts`), and the mean over the steps after the variance freeze
alone (the phase that published throughput figures describe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_zeroone.optim import StepKind
from hf_zeroone.plan._measure import GRADIENT_BYTES, Measurements, step_kind_counts
from hf_zeroone.plan._network import Cluster

__all__ = ["DILOCO_PERIODS", "Projection", "break_even_rate", "compressed_step", "ddp_step", "project"]

#: the step kinds of the optimizers' phase after the variance freeze
AFTER_FREEZE = (StepKind.ONEBIT_MOMENTUM, StepKind.LOCAL, StepKind.ONEBIT_SYNC)
#: DiLoCo's periods ``H`` in the projections: an fp32 allreduce of the parameters every ``H`` steps
DILOCO_PERIODS = (16, 64)


@dataclass
class Projection:
    """One method on one cluster: mean seconds and bytes a rank sends, per step."""

    method: str
    seconds: float
    bytes_per_step: float
    speedup: float = math.nan  # DDP fp32's seconds over this method's


def _exposed(cluster: Cluster, m: Measurements, seconds: float, in_backward: bool) -> float:
    if not (cluster.overlap and in_backward):
        return seconds
    return max(seconds - m.backward, seconds / m.buckets)


def ddp_step(cluster: Cluster, m: Measurements, element_bytes: int) -> tuple[float, float]:
    """DDP with AdamW and gradients of ``element_bytes`` per element: seconds and bytes a rank sends per step."""
    payload = element_bytes * m.parameters
    comm = cluster.ring_allreduce_seconds(payload, m.buckets)
    p = cluster.ranks
    return m.forward + m.backward + m.adamw_step + _exposed(cluster, m, comm, True), 2 * (p - 1) / p * payload


def compressed_step(cluster: Cluster, m: Measurements, name: str, counts: dict[StepKind, int]) -> tuple[float, float]:
    """``name`` (a key of ``m.kinds``) taking ``counts`` steps of each kind: mean seconds and bytes per step."""
    costs = m.kinds[name]
    total = sum(counts.values())
    seconds = sent = 0.0
    for kind, n in counts.items():
        cost = costs[kind]
        comm = cluster.two_stage_seconds(cost.bytes_sent, cost.collectives)
        seconds += n * (m.forward + m.backward + cost.seconds + _exposed(cluster, m, comm, cost.in_backward))
        sent += n * cost.bytes_sent
    return seconds / total, sent / total


def project(m: Measurements, cluster: Cluster, steps: int, warmup_steps: int = 0) -> list[Projection]:
    """Every method's projection on ``cluster`` for a run of ``steps`` optimizer steps (``warmup_steps`` of LR warm-up).

    ``m`` must have been measured for ``cluster.ranks`` ranks.
    """
    if m.world_size != cluster.ranks:
        raise ValueError(f"measured for {m.world_size} ranks, projected for {cluster.ranks}: measure again")
    p = cluster.ranks
    rows = [Projection(f"DDP {name} gradients + AdamW", *ddp_step(cluster, m, n)) for name, n in GRADIENT_BYTES.items()]
    psgd_comm = cluster.ring_allreduce_seconds(m.powersgd_bytes, 3 * m.buckets)  # P, Q and the uncompressed
    rows.append(Projection(
        "DDP PowerSGD hook (rank 4) + AdamW",
        m.forward + m.backward + m.adamw_step + m.powersgd_seconds + _exposed(cluster, m, psgd_comm, True),
        2 * (p - 1) / p * m.powersgd_bytes,
    ))  # fmt: skip
    for name in m.kinds:
        counts = step_kind_counts(name, steps, warmup_steps)
        rows.append(Projection(f"{name} + hook", *compressed_step(cluster, m, name, counts)))
        frozen = {k: n for k, n in counts.items() if k in AFTER_FREEZE}
        if frozen:  # the phase the papers' throughput figures describe
            rows.append(Projection(f"{name} + hook, after the freeze", *compressed_step(cluster, m, name, frozen)))
    fp32 = 4 * m.parameters
    for h in DILOCO_PERIODS:
        outer = cluster.ring_allreduce_seconds(fp32, m.buckets) / h
        rows.append(Projection(f"DiLoCo H={h} (AdamW inside)", m.forward + m.backward + m.adamw_step + outer,
                               2 * (p - 1) / p * fp32 / h))  # fmt: skip
    base = rows[0].seconds
    for row in rows:
        row.speedup = base / row.seconds if row.seconds > 0 else math.nan
    return rows


def break_even_rate(m: Measurements, cluster: Cluster, method: str, steps: int, warmup_steps: int = 0) -> float:
    """The rate between nodes (bits/s) below which ``method`` is faster than DDP with fp32 gradients.

    ``inf``: faster at every rate up to 10 Tbit/s; ``0``: slower at every rate down to 1 Mbit/s.
    """

    def gap(rate: float) -> float:
        rows = {r.method: r.seconds for r in project(m, cluster.with_inter_rate(rate), steps, warmup_steps)}
        return rows[method] - rows["DDP fp32 gradients + AdamW"]

    low, high = math.log(1e6), math.log(1e13)
    if gap(math.exp(high)) < 0:
        return math.inf
    if gap(math.exp(low)) >= 0:
        return 0.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if gap(math.exp(mid)) < 0 else (low, mid)
    return math.exp(low)
