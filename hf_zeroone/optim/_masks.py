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

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "activity_flags",
    "build_masks",
    "clear_activity",
    "known_variance",
    "index_masked_rows",
    "mask_local_gradients",
    "masked_rows",
    "note_activity",
    "release_masked_rows",
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


def index_masked_rows(state: dict[str, Any]) -> None:
    """Keep ``masked_rows_index`` (the indices of the masked rows) in step with ``momentum_mask``.

    Flags of masked rows travel in the exact lane of a step's collectives; with the index, the DDP
    hook gathers and scatters them without reading a device value on the host (the count of
    masked rows is the index's length). Called wherever the mask changes, and on load.
    """
    if "momentum_mask" in state:
        state["masked_rows_index"] = masked_rows(state).nonzero().squeeze(1)
    else:
        state.pop("masked_rows_index", None)


def note_activity(state: dict[str, Any], grad: Tensor) -> None:
    """Remember the masked rows in which this rank's local gradient is non-zero.

    NaN is not activity: a GradScaler's overflow is sent as NaN (and its step skipped on every
    rank), and counted as activity it would release every masked row at the next step.
    """
    if "momentum_mask" not in state or grad is None:
        return
    r = rows(grad)
    active = ((r > 0) | (r < 0)).any(dim=1) & masked_rows(state)  # bool temporaries, not a copy of the gradient
    pending = state.get("pending_rows")
    state["pending_rows"] = active if pending is None else pending | active


def mask_local_gradients(states: list[dict[str, Any]], grads: list[Tensor], values: list[Tensor]) -> list[Tensor]:
    """The gradients of a local step with masked elements zeroed (masked rows that ``values`` touch are noted).

    Masked elements stay out of local steps as they stay out of compression: their momentum stays
    zero. (Their v is usually zero too, so ``m / (sqrt(v) + eps)`` would move them by up to
    ``lr * (1 - beta1) * g / eps``, and every sync would undo it.)
    """
    out = list(grads)
    for i, (state, value) in enumerate(zip(states, values)):
        if "momentum_mask" in state:
            note_activity(state, value)
            out[i] = grads[i] * state["momentum_mask"]
    return out


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
    index_masked_rows(state)


def known_variance(state: dict[str, Any]) -> tuple[float, int]:
    """Sum (in float32) and count of the non-zero variances of the unmasked elements.

    Masked elements are left out by zeros in their place, and a zero variance is neither summed
    nor counted. Selecting the known elements instead (``v[known]``) would list each one's
    coordinates first, 16 bytes per element: a memory spike on the step that releases rows (after
    float8 exact steps, the first compression step).
    """
    v = state["exp_avg_sq"]
    if "momentum_mask" in state:
        v = torch.where(state["momentum_mask"], v, torch.zeros((), dtype=v.dtype, device=v.device))
    return float(v.float().sum()), int(torch.count_nonzero(v))


def clear_activity(state: dict[str, Any]) -> None:
    state.pop("pending_rows", None)


def released_by_variance(state: dict[str, Any]) -> Tensor:
    """Masked rows with a non-zero variance (a step with exact gradients updated it)."""
    return masked_rows(state) & (rows(state["exp_avg_sq"]) != 0).any(dim=1)


def activity_flags(state: dict[str, Any]) -> Tensor:
    """One float per masked row (:func:`index_masked_rows` order): 1 where this rank saw a gradient."""
    index = state["masked_rows_index"]
    pending = state.get("pending_rows")
    if pending is None:
        return torch.zeros(index.numel(), dtype=torch.float32, device=index.device)
    return pending.index_select(0, index).float()


def scatter_flags(state: dict[str, Any], flags: Tensor) -> Tensor:
    """Boolean per row from the agreed flags of the masked rows (:func:`activity_flags` order)."""
    index = state["masked_rows_index"]
    released = torch.zeros(rows(state["momentum_mask"]).shape[0], dtype=torch.bool, device=index.device)
    return released.scatter_(0, index, flags.to(index.device) > 0)


def build_masks(trainable: list[tuple[dict[str, Any], Tensor]], state_of, auto: bool) -> None:  # noqa: ANN001
    """Fix, once, which elements take part in compression (``auto_momentum_mask`` and ``exp_avg_mask``)."""
    for group, p in trainable:
        state = state_of(p)
        mask = None
        if auto:
            nonzero = state["exp_avg_sq"] != 0
            if not bool(nonzero.all()):
                mask = nonzero
        user = _user_mask(group, p)
        if user is not None:
            mask = user if mask is None else mask & user
        if mask is not None:
            state["momentum_mask"] = mask.clone()
            index_masked_rows(state)


def _user_mask(group: dict[str, Any], p: Tensor) -> Tensor | None:
    user = group.get("exp_avg_mask")
    return None if user is None else torch.broadcast_to(user.to(p.device) != 0, p.shape)


def release_masked_rows(
    trainable: list[tuple[dict[str, Any], Tensor]],
    state_of,  # noqa: ANN001 - Tensor -> its state dict
    exact: bool,
    agree: Callable[[Tensor], Tensor],
    around_release: Callable[[dict[str, Any], Tensor, Callable[[], None]], None] | None = None,
) -> set[int]:
    """Unmask the rows that received a gradient on any rank; returns the ``id`` of every changed parameter.

    On a step with exact gradients (``exact``) the variance says which rows had one. On a 1-bit
    step the ranks agreed in the exact lane of the step's collectives (``agreed_rows``, set by
    :meth:`~hf_zeroone.optim._messages.Messages.finish`); where a parameter has none, ``agree``
    averages every rank's activity flags (one float per masked row) across ranks.
    ``around_release(group, p, release)``, if given, calls ``release()`` (which writes into ``v``)
    with the caller's own work around it.
    """
    masked = [(g, p, state_of(p)) for g, p in trainable if "momentum_mask" in state_of(p)]
    if not masked:
        return set()
    agreed_in_lane = [s.pop("agreed_rows", None) for _, _, s in masked]
    if exact:
        released = [released_by_variance(s) for _, _, s in masked]
    elif all(a is not None for a in agreed_in_lane):
        released = agreed_in_lane
    else:
        flags = [activity_flags(s) for _, _, s in masked]
        agreed = agree(torch.cat(flags))
        released = [scatter_flags(s, f) for (_, _, s), f in zip(masked, agreed.split([len(f) for f in flags]))]
    everywhere = None  # mean known variance over all tensors, computed only if needed
    changed: set[int] = set()
    for (group, p, state), released_rows in zip(masked, released):
        clear_activity(state)
        if not bool(released_rows.any()):
            continue
        total, count = known_variance(state)
        if count == 0:  # no element of this tensor has a variance: the mean of all tensors
            if everywhere is None:
                sums = [known_variance(state_of(q)) for _, q in trainable]
                n = sum(c for _, c in sums)
                everywhere = sum(t for t, _ in sums) / n if n else 0.0
            total, count = everywhere, 1
        if total == 0.0:
            continue

        def release(state=state, released_rows=released_rows, group=group, p=p, total=total, count=count) -> None:
            release_rows(state, released_rows, _user_mask(group, p), total / count)

        if around_release is None:
            release()
        else:  # the caller's work around the change of v (the error buffers' units)
            around_release(group, p, release)
        changed.add(id(p))
    return changed
