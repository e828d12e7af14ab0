"""Communication statistics as flat dicts of numbers, for Trainer logs and custom loops."""

from __future__ import annotations

from typing import Any

from hf_zeroone.comm import CommStats
from hf_zeroone.optim import HF_ZEROONE_OPTIMIZERS, CompressedAdamBase, ZeroOneAdam


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer under Accelerate / Trainer wrappers (``.optimizer`` chains)."""
    while not isinstance(optimizer, HF_ZEROONE_OPTIMIZERS) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def comm_log_entries(opt: CompressedAdamBase, since: CommStats | None = None, hooked: bool = True) -> dict[str, float]:
    """What ``opt`` has communicated, as numbers.

    Keys: ``comm/bytes_sent`` (since ``since``, this rank), ``comm/bytes_total``,
    ``comm/fp32_equivalent_bytes_total`` (what fp32 allreduces of the same values would have
    sent), ``comm/compression_ratio`` (fp32-equivalent over sent; left out while this process has
    sent nothing, e.g. in a single process), ``comm/collectives`` (since ``since``), ``comm/hook``
    (1 when the DDP hook carries the communication), ``comm/local_phase`` (1 during 0/1 Adam's
    local steps; always 1 for OneBitDiLoCo), and for 0/1 Adam ``comm/var_interval`` and ``comm/local_step_interval``.
    Totals count from the start of this process (a resumed run starts again from 0).
    """
    total = opt.comm_stats
    delta = total - (since or CommStats())
    entries: dict[str, float] = {
        "comm/bytes_sent": delta.bytes_sent,
        "comm/bytes_total": total.bytes_sent,
        "comm/fp32_equivalent_bytes_total": total.fp32_equivalent_bytes,
        "comm/collectives": delta.collectives,
        "comm/hook": int(hooked),
        "comm/local_phase": 0,
    }
    if total.bytes_sent:  # a ratio over nothing sent would be 0 or infinite, both misleading
        entries["comm/compression_ratio"] = round(total.compression_ratio, 3)
    if not isinstance(opt, CompressedAdamBase):  # OneBitDiLoCo: every step is local, the syncs between
        entries["comm/local_phase"] = 1
    if isinstance(opt, ZeroOneAdam):
        summary = opt.schedule_summary()
        entries["comm/local_phase"] = int(summary["phase"] == "local")
        entries["comm/var_interval"] = summary["var_interval"]
        entries["comm/local_step_interval"] = summary["local_step_interval"]
    return entries
