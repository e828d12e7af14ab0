"""Momentum masks that follow the data: rows that start receiving gradients leave the mask.

The automatic mask (``auto_momentum_mask``) keeps out of compression the elements whose variance
was exactly zero when compression started: one bit cannot say zero, so they would collect
compression error and drift. Such an element usually belongs to a *row* (an embedding row of a
token not seen yet). When that token appears later, its row must start training, and every rank
must agree on when, since the mask shapes the compressed layout.

Each rank notes, per parameter, the masked rows in which its local gradient was non-zero
(:func:`note_activity`). The optimizer then makes the ranks agree (one small allreduce of one
float per masked row, or, on a step with exact gradients, the variance itself) and releases the
rows that any rank saw (:func:`release_rows`). A released row has no variance estimate of its
own: it gets the mean variance of the tensor's unmasked elements (the same on every rank), zero
momentum, and joins compression from the next step. A row that never receives a gradient stays
masked and never moves.

Rows are slices along dimension 0 of a tensor with two or more dimensions, and single elements of
other tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = [
    "activity_flags",
    "clear_activity",
    "known_variance",
    "masked_rows",
    "note_activity",
    "release_rows",
    "released_by_variance",
    "rows",
    "scatter_flags",
]


def rows(t: Tensor) -> Tensor:
    """``t`` as a 2-D view, one row per slice along dimension 0 (per element for 0-D / 1-D)."""
    return t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(-1, 1)


def masked_rows(state: dict[str, Any]) -> Tensor:
    """Boolean per row: the row has a masked element."""
    return ~rows(state["momentum_mask"]).all(dim=1)


def note_activity(state: dict[str, Any], grad: Tensor) -> None:
    """Remember the masked rows in which this rank's local gradient is non-zero."""
    if "momentum_mask" not in state or grad is None:
        return
    active = (rows(grad) != 0).any(dim=1) & masked_rows(state)
    pending = state.get("pending_rows")
    state["pending_rows"] = active if pending is None else pending | active


def release_rows(state: dict[str, Any], released: Tensor, user_mask: Tensor | None, fallback_variance: float) -> None:
    """Take the ``released`` rows (boolean per row) out of the mask, except user-masked elements.

    Elements of those rows whose variance is zero get ``fallback_variance``; their momentum is
    reset. The state entry ``momentum_mask`` is dropped when nothing is masked any more.
    """
    mask = rows(state["momentum_mask"])
    newly = (~mask) & released.unsqueeze(1)
    if user_mask is not None:
        newly &= rows(user_mask)
    if not bool(newly.any()):
        return
    v, m = rows(state["exp_avg_sq"]), rows(state["exp_avg"])
    v[newly & (v == 0)] = fallback_variance
    m[newly] = 0
    mask |= newly
    if bool(mask.all()):
        del state["momentum_mask"]


def known_variance(state: dict[str, Any]) -> tuple[float, int]:
    """Sum and count of the non-zero variances of the unmasked elements."""
    v = state["exp_avg_sq"]
    known = v != 0
    if "momentum_mask" in state:
        known &= state["momentum_mask"]
    return float(v[known].float().sum()), int(known.sum())


def clear_activity(state: dict[str, Any]) -> None:
    state.pop("pending_rows", None)


def released_by_variance(state: dict[str, Any]) -> Tensor:
    """Masked rows with a non-zero variance (a step with exact gradients updated it)."""
    return masked_rows(state) & (rows(state["exp_avg_sq"]) != 0).any(dim=1)


def activity_flags(state: dict[str, Any]) -> Tensor:
    """One float per masked row: 1 where this rank saw a gradient (for an allreduce)."""
    masked = masked_rows(state)
    pending = state.get("pending_rows")
    if pending is None:
        return torch.zeros(int(masked.sum()), dtype=torch.float32, device=masked.device)
    return pending[masked].float()


def scatter_flags(state: dict[str, Any], flags: Tensor) -> Tensor:
    """Boolean per row from the agreed flags of the masked rows (:func:`activity_flags` order)."""
    masked = masked_rows(state)
    released = torch.zeros_like(masked)
    released[masked] = flags > 0
    return released
