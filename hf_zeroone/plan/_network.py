"""The cluster's links and the time a collective takes on them: bandwidth and latency terms.

Two traffic patterns cover every collective of a data-parallel step:

* **ring** (an allreduce as NCCL and gloo run it, an all-gather): each rank passes its bytes to
  the next rank of a ring. Consecutive ranks of a node share it, so each node's link out of the
  node carries one rank's stream. The slowest hop sets the pace; a ring allreduce takes
  ``2 (P - 1)`` latency steps, an all-gather ``P - 1``.
* **pairwise** (an all-to-all): each rank sends an equal share of its bytes to every other rank.
  A node's link then carries the shares of all its ranks to the other nodes,
  ``g * (P - g) / (P - 1)`` of one rank's bytes for ``g`` ranks per node: about ``g`` times a
  ring's load. Messages to all peers are in flight together: one latency step.

A ``shared`` cluster is one medium that every rank's traffic crosses (a hub, or the rate-limited
loopback of ``recipes/benchmark.py``): the time is all ranks' bytes over its rate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Cluster", "parse_latency", "parse_rate"]

_RATE_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """Bits per second of a rate such as ``40gbit``, ``300mbit``, ``1.5tbit`` or ``800kbit``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)bit\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"cannot read the rate {text!r}: give positive bits per second, e.g. 40gbit, 300mbit")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def parse_latency(text: str) -> float:
    """Seconds of a latency such as ``5us``, ``0.2ms`` or ``0``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(s|ms|us|ns)?\s*", text.lower())
    if not m or (m.group(2) is None and float(m.group(1)) != 0):
        raise ValueError(f"cannot read the latency {text!r}: give a number with a unit, e.g. 5us, 0.2ms, 0")
    return float(m.group(1)) * _TIME_UNITS[m.group(2) or "s"]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` ranks; rates in bits per second, latencies in seconds.

    ``shared``: every rank's traffic crosses one medium of rate ``inter_rate`` (see the module).
    ``overlap``: whether communication in backward overlaps the backward pass (a GPU's
    communication stream); with one CPU core per rank it does not.
    """

    nodes: int
    gpus_per_node: int
    inter_rate: float
    intra_rate: float
    inter_latency: float = 20e-6
    intra_latency: float = 5e-6
    shared: bool = False
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"a cluster needs at least one node of one rank, got {self.nodes} x {self.gpus_per_node}")
        if min(self.inter_rate, self.intra_rate) <= 0 or min(self.inter_latency, self.intra_latency) < 0:
            raise ValueError("rates must be positive and latencies not negative")

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_inter_rate(self, rate: float) -> Cluster:
        """The same cluster with another rate between nodes (the shared medium's, if ``shared``)."""
        return Cluster(self.nodes, self.gpus_per_node, rate, self.intra_rate, self.inter_latency,
                       self.intra_latency, self.shared, self.overlap)  # fmt: skip

    def _latency(self) -> float:
        return self.inter_latency if self.nodes > 1 or self.shared else self.intra_latency

    def seconds(self, bytes_per_rank: float, pattern: str, latency_steps: float) -> float:
        """Time of collectives in which every rank sends ``bytes_per_rank`` in ``pattern`` (``ring``, ``pairwise``)."""
        p, g = self.ranks, self.gpus_per_node
        if p == 1 or bytes_per_rank <= 0:
            return 0.0
        bits = 8.0 * bytes_per_rank
        if self.shared:
            wire = p * bits / self.inter_rate
        elif pattern == "ring":
            wire = bits / (self.inter_rate if self.nodes > 1 else self.intra_rate)
            if self.nodes > 1 and g > 1:  # the ring also passes through each node's ranks
                wire = max(wire, bits / self.intra_rate)
        elif pattern == "pairwise":
            wire = bits * (g - 1) / (p - 1) / self.intra_rate if g > 1 else 0.0
            if self.nodes > 1:
                wire = max(wire, bits * g * (p - g) / (p - 1) / self.inter_rate)
        else:
            raise ValueError(f"unknown traffic pattern {pattern!r}")
        return wire + latency_steps * self._latency()

    def ring_allreduce_seconds(self, payload_bytes: float, calls: int = 1) -> float:
        """``calls`` ring allreduces of ``payload_bytes`` in all (each rank sends ``2 (P-1)/P`` of it)."""
        p = self.ranks
        return self.seconds(2 * (p - 1) / p * payload_bytes, "ring", 2 * (p - 1) * calls) if p > 1 else 0.0

    def two_stage_seconds(self, bytes_per_rank: float, calls: float) -> float:
        """hf_zeroone's collectives: an all-to-all and an all-gather per allreduce, half the bytes each.

        ``calls``: the collectives of the step (each pair is one allreduce); the lanes of exact
        floats ride in them.
        """
        p = self.ranks
        if p == 1:
            return 0.0
        half = bytes_per_rank / 2
        pairs = calls / 2
        return self.seconds(half, "pairwise", pairs) + self.seconds(half, "ring", pairs * (p - 1))
