"""0/1 Adam's local phase: the parameters of the last sync, the displacement ``u`` and the sync.

Functions over one parameter and its state; the maths is in
:class:`~hf_zeroone.optim.ZeroOneAdam`'s docstring.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hf_zeroone._tensors import all_finite
from hf_zeroone.optim._step_kind import StepKind

__all__ = [
    "accumulates_displacement",
    "apply_sync",
    "discard_interval",
    "displacement",
    "note_local_step",
    "start_local_phase",
    "sync",
]


def accumulates_displacement(p: Tensor) -> bool:
    """Whether ``p`` keeps 0/1 Adam's ``u`` in a buffer instead of deriving it (see :func:`displacement`)."""
    return p.dtype not in (torch.float32, torch.float64)


def displacement(p: Tensor, state: dict[str, Any], out: Tensor) -> None:
    """0/1 Adam's ``u`` for ``p`` into ``out`` (fp32): what the local steps since the last sync moved it.

    Derived as ``u = decay_prod * sync_param - p`` (no buffer held): a sync then sets
    ``p = decay_prod * sync_param - u_avg``, which without compression is exactly where the local
    steps left ``p``. A parameter below fp32 (bf16, fp16) accumulates ``u`` in a buffer instead,
    since each local step's rounding of ``p`` to its own precision would drop updates the
    accumulator keeps.
    """
    if "update_accumulator" in state:
        out.copy_(state["update_accumulator"])
    elif p.dtype == out.dtype:
        torch.mul(state["sync_param"], state["decay_prod"], out=out).sub_(p)
    else:
        out.copy_(state["sync_param"].mul(state["decay_prod"]).sub_(p))


def apply_sync(
    p: Tensor, state: dict[str, Any], combined_u: Tensor, c1: float, denominator: Callable[[], Tensor]
) -> None:
    """Back to the last synced parameters, then the averaged displacement (in parameter space).

    The momentum is re-estimated from it, ``m = c1 * d * u / sum(lr)``, with ``d = denominator()``.
    """
    combined_u = combined_u.to(p.dtype)
    p.copy_(state["sync_param"]).mul_(state["decay_prod"]).sub_(combined_u)
    if state["lr_sum"] > 0:
        state["exp_avg"].copy_(combined_u).mul_(denominator()).mul_(c1 / state["lr_sum"])
    if "update_accumulator" in state:
        if accumulates_displacement(p):
            state["update_accumulator"].zero_()
        else:  # derived from now on (a checkpoint of an earlier version brought one)
            del state["update_accumulator"]
    state["sync_param"].copy_(p)
    state["lr_sum"], state["decay_prod"] = 0.0, 1.0


def note_local_step(states: list[dict[str, Any]], dens: list[Tensor], lr: float, c1: float, decay: float) -> None:
    """Book a local step's learning rate and decay (and, below fp32, its update) towards the next sync."""
    for state, d in zip(states, dens):
        if "update_accumulator" in state:  # low-precision parameters, see displacement()
            state["update_accumulator"].addcdiv_(state["exp_avg"], d, value=lr / c1)
        state["lr_sum"] += lr
        state["decay_prod"] *= decay


def discard_interval(p: Tensor, state: dict[str, Any]) -> None:
    """Back to the last synced parameters with zero momentum: identical and finite on every rank."""
    p.copy_(state["sync_param"])
    state["exp_avg"].zero_()
    if "update_accumulator" in state:
        state["update_accumulator"].zero_()
    state["lr_sum"], state["decay_prod"] = 0.0, 1.0


def start_local_phase(params: list[Tensor], state_of: Callable[[Tensor], dict[str, Any]]) -> None:
    """Entering local steps: remember the synced parameters, reset ``u`` and the error buffers."""
    for p in params:
        state = state_of(p)
        state["sync_param"] = p.detach().clone()
        if accumulates_displacement(p):
            state["update_accumulator"] = torch.zeros_like(p)
        else:
            state.pop("update_accumulator", None)
        state["lr_sum"], state["decay_prod"] = 0.0, 1.0
        # The errors so far belong to compressed gradients, not to u (as DeepSpeed does).
        for key in ("worker_error", "server_error"):
            if key in state:
                state[key].zero_()


def sync(opt: Any, synced: list[tuple[dict[str, Any], Tensor, Tensor]]) -> None:  # noqa: ANN401
    """Apply a sync's averaged displacements (``(group, param, u)``, identical on every rank) to ``opt``.

    A non-finite average (an overflowing local update on some rank) discards the local steps since
    the last sync on every rank instead, with a warning.
    """
    if all_finite(v for _, _, v in synced):
        for group, p, value in synced:
            c1, c2 = opt._coefficients(group, StepKind.ONEBIT_SYNC)
            denominator = lambda g=group, p=p, c2=c2: opt._denominators(g, [p], StepKind.ONEBIT_SYNC, c2)[0]  # noqa: E731
            apply_sync(p, opt.state[p], value, c1, denominator)
        return
    # The combined u is identical on every rank, so every rank takes this branch.
    warnings.warn(
        f"{type(opt).__name__}: non-finite values in the sync at step {opt.schedule['step']}: the local steps "
        "since the last sync are discarded on all ranks (parameters back to the last synced values, momentum "
        "reset). Lower the learning rate or clip gradients if it repeats.",
        RuntimeWarning,
        stacklevel=3,
    )
    for _, p, _ in synced:
        discard_interval(p, opt.state[p])
