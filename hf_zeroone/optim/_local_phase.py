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

from hf_zeroone._tensors import all_finite, apply_per_tensor, by_value, moved
from hf_zeroone.optim._functional import as_dtypes, by_group
from hf_zeroone.optim._scalar_vectors import Noted
from hf_zeroone.optim._step_kind import StepKind

__all__ = [
    "accumulates_displacement",
    "apply_sync",
    "discard_interval",
    "displacement",
    "displacements",
    "idle_messages",
    "new_displacements",
    "note_local_step",
    "per_lr_units",
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


def displacements(params: list[Tensor], states: list[dict[str, Any]], outs: list[Tensor]) -> None:
    """:func:`displacement` of every parameter into ``outs``, the float32 ones in multi-tensor form."""
    plain = [i for i, (p, st, out) in enumerate(zip(params, states, outs)) if displacement_is_derived(p, st, out)]
    if plain:
        derived, synced = [outs[i] for i in plain], [states[i]["sync_param"] for i in plain]
        decays, moved = [float(states[i]["decay_prod"]) for i in plain], [params[i] for i in plain]
        torch._foreach_copy_(derived, synced)
        _scale_unless_one(derived, decays)
        torch._foreach_sub_(derived, moved)
    done = set(plain)
    for i, (p, st, out) in enumerate(zip(params, states, outs)):
        if i not in done:
            displacement(p, st, out)


def new_displacements(params: list[Tensor], states: list[dict[str, Any]]) -> list[Tensor]:
    """:func:`displacement` of every parameter, as new float32 tensors (a sync's values in one process)."""
    outs = [torch.empty_like(p, dtype=torch.float32) for p in params]
    displacements(params, states, outs)
    return outs


def _scale_unless_one(tensors: list[Tensor], factors: list[float]) -> None:
    """Multiply each tensor by its factor in place, one call per distinct factor; those of factor 1 are left alone."""
    scaled = [i for i, f in enumerate(factors) if f != 1.0]
    if scaled:
        apply_per_tensor("mul", [tensors[i] for i in scaled], [factors[i] for i in scaled], in_place=True)


def displacement_is_derived(p: Tensor, state: dict[str, Any], out: Tensor) -> bool:
    """Whether ``u`` of ``p`` is derived from the synced parameters in the output's own dtype."""
    return "update_accumulator" not in state and p.dtype == out.dtype


def per_lr_units(states: list[dict[str, Any]], scale_factors: Tensor | None = None) -> list[float] | Tensor:
    """The divisor of each ``u`` in a sync's 1-bit message: the learning rate summed over the interval.

    ``u / sum(lr)`` is the interval's mean update per unit of learning rate (``m / (c1 d)``
    averaged over its steps): the units of 1-bit Adam's momentum messages. The compression error a
    sync leaves in the error-feedback buffer is then paid back, at a later sync, times *that*
    interval's learning rate. Sent in parameter space instead, an error made while the learning
    rate was high is paid back in full when it has decayed: with a learning rate that decays to
    zero, the late syncs then deviate from the exact average by many learning rates per step, and
    0/1 Adam ends clearly above AdamW's loss even with a sync at every step. A parameter with no
    learning rate over the interval (``sum(lr) = 0``) sends its momentum instead
    (:func:`idle_messages`).

    ``scale_factors``: ``follow_gradient_scale``'s factor ``f`` of each tensor (a vector, 1 where a
    tensor has none; ``None``: the option is off), by
    which the local steps' denominators ``d = sqrt(v f / c2) + eps`` moved away from the frozen
    ``v``'s. The divisor is then ``sum(lr) / sqrt(f)``: the message is ``m / (c1 d)`` with the
    *frozen* ``d``, units that stay put while ``v`` is frozen, as 1-bit Adam's do. In units that
    follow ``f`` an error kept at one sync is paid back at the next in units that have moved, and
    error feedback no longer sums to the exact average: where the gradient's scale falls far after
    the freeze (the least squares of ``tests/test_convergence_defaults.py``), 0/1 Adam then ends
    clearly above AdamW's loss, and in frozen units close to it. Returns a float32 vector then.
    """
    lr_sums = [st["lr_sum"] if st["lr_sum"] > 0 else 1.0 for st in states]
    if scale_factors is None:
        return lr_sums
    device = scale_factors.device
    return torch.tensor(lr_sums, dtype=torch.float32, device=device) / moved(scale_factors, dtype=torch.float32).sqrt()


def idle_messages(opt: Any, params: list[Tensor], states: list[dict[str, Any]], outs: list[Tensor]) -> None:  # noqa: ANN401
    """A sync's message where the interval's summed learning rate is 0: the momentum ``m / d``, into ``outs``.

    No local step moved such a parameter (``u = 0``), and ``u / sum(lr)`` has no value. The
    momentum per unit of the denominator stands in for it (its limit for one step at a vanishing
    rate): :func:`apply_sync` then leaves the parameter where it is and sets ``m = d * mean(m / d)``,
    the same momentum on every rank. Error feedback pays what it withheld at the interval's rate,
    0, as it does at any other rate.
    """
    idle = [i for i, st in enumerate(states) if not st["lr_sum"] > 0]
    if not idle:
        return
    for group, ps, index in opt.grouped([params[i] for i in idle], idle):
        c2 = opt._coefficients(group, StepKind.ONEBIT_SYNC)[1]
        for i, d in zip(index, opt._denominators(group, ps, StepKind.ONEBIT_SYNC, c2)):
            outs[i].copy_(torch.div(states[i]["exp_avg"], d))


def apply_sync(
    params: list[Tensor], states: list[dict[str, Any]], combined_u: list[Tensor], c1: float, dens: list[Tensor]
) -> None:
    """Back to the last synced parameters, then the averaged displacement (in parameter space).

    ``p = decay_prod * sync_param - u`` and the momentum is re-estimated from ``u``,
    ``m = c1 * d * u / sum(lr)``, with ``d`` from ``dens``; for all tensors of one group at once.
    Where the interval's summed learning rate is 0 the parameter stays at ``sync_param`` and the
    combined value is a momentum (:func:`idle_messages`): ``m = d * u``.
    """
    us = as_dtypes(combined_u, params)
    idle = [i for i, st in enumerate(states) if not st["lr_sum"] > 0]
    for i in idle:
        params[i].copy_(states[i]["sync_param"])
        torch.mul(us[i], dens[i], out=states[i]["exp_avg"])
        states[i]["lr_sum"], states[i]["decay_prod"] = 0.0, 1.0
    if idle:
        moving = sorted(set(range(len(params))) - set(idle))
        params, states, us, dens = ([xs[i] for i in moving] for xs in (params, states, us, dens))
        if not params:
            return
    synced, decays = [st["sync_param"] for st in states], [float(st["decay_prod"]) for st in states]
    scales = [c1 / st["lr_sum"] for st in states]
    exp_avgs = [st["exp_avg"] for st in states]
    torch._foreach_copy_(params, synced)
    _scale_unless_one(params, decays)
    torch._foreach_sub_(params, us)
    torch._foreach_zero_(exp_avgs)
    for scale, index in by_value(scales).items():  # one call per distinct scale (one per group, as a rule)
        torch._foreach_addcmul_([exp_avgs[i] for i in index], [us[i] for i in index], [dens[i] for i in index], scale)
    for p, st in zip(params, states):
        if "update_accumulator" in st:
            if accumulates_displacement(p):
                st["update_accumulator"].zero_()
            else:  # derived from now on (an older checkpoint brought one)
                del st["update_accumulator"]
        st["lr_sum"], st["decay_prod"] = 0.0, 1.0
    torch._foreach_copy_(synced, params)


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


def sync(opt: Any, synced: list[tuple[dict[str, Any], Tensor, Tensor]], step: int | None = None) -> None:  # noqa: ANN401
    """Apply a sync's averaged displacements (``(group, param, u)``, identical on every rank) to ``opt``.

    ``step``: the step whose bias correction re-estimates the momentum (default: the coming one,
    a scheduled sync; a sync between steps uses the last step's).

    A non-finite average (an overflowing local update on some rank) discards the local steps since
    the last sync on every rank instead, with a warning.
    """
    pooled, opt.messages.pending_means = opt.messages.pending_means, Noted()
    pending = []  # (group, params, the interval's summed local samples averaged over ranks, one vector)
    for group, params, _ in by_group(synced) if opt.follow_gradient_scale else ():
        if opt.comm.is_distributed:  # the means from the sync's exact lane
            positions, sums = pooled.gather(params)
            params = [params[i] for i in positions]
        else:  # one process: its own sums are the mean
            sums = opt.gradient_scale.pending([opt.state[p] for p in params], params[0])
        if params:
            pending.append((group, params, sums))
    if all_finite(v for _, _, v in synced):
        for group, params, values in by_group(synced):
            states = [opt.state[p] for p in params]
            c1, c2 = opt._coefficients(group, StepKind.ONEBIT_SYNC, step)
            dens = opt._denominators(group, params, StepKind.ONEBIT_SYNC, c2)
            apply_sync(params, states, values, c1, dens)
        if opt.follow_gradient_scale:  # the interval's gradient scale, pooled over ranks: the same G everywhere
            opt.gradient_scale.fold_pending(pending, lambda p: opt.state[p], opt.schedule)
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
