"""What a rank sends, counted exactly: :class:`CommStats` and the fp32 allreduce it is compared with."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["CommStats", "fp32_allreduce_bytes"]


def fp32_allreduce_bytes(numel: int, world_size: int, element_size: int = 4) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements: ``2 (P-1)/P * size``."""
    if world_size <= 1:
        return 0
    return math.ceil(2 * (world_size - 1) * numel * element_size / world_size)


@dataclass
class CommStats:
    """What one rank sent: bytes, collective calls, and allreduces of each kind.

    Counted exactly when each collective is issued (the payload this rank puts on the wire under
    a ring / pairwise model: ``(P-1) * w`` for an all-to-all or all-gather of ``w`` bytes per
    peer, ``2 (P-1)/P * b`` for an allreduce of ``b`` bytes). ``fp32_equivalent_bytes`` is what
    an fp32 ring allreduce of the same elements would have sent, for compression ratios.
    """

    bytes_sent: int = 0
    collectives: int = 0
    full_allreduces: int = 0
    compressed_allreduces: int = 0
    fp32_equivalent_bytes: int = 0
    #: the one-time check that every rank built the optimizer alike (:meth:`Communicator.gather_setup`),
    #: not in ``bytes_sent`` and ``collectives``, which count the training's traffic
    setup_bytes: int = 0
    setup_collectives: int = 0
    #: the replica checks (:meth:`Communicator.assert_identical`, ``check_replicas_every``), not in
    #: ``bytes_sent`` and ``collectives`` either (by default one every 100 backward passes or steps)
    check_bytes: int = 0
    check_collectives: int = 0

    def copy(self) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def compression_ratio(self) -> float:
        """fp32-equivalent bytes divided by bytes actually sent (``inf`` when nothing was sent)."""
        return self.fp32_equivalent_bytes / self.bytes_sent if self.bytes_sent else math.inf

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
