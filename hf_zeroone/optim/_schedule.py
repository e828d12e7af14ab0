"""Schedules derived from the run length and the LR warm-up: the variance freeze, 0/1 Adam's local steps.

1-bit Adam freezes Adam's ``v`` at ``freeze_step`` and compresses from there; 0/1 Adam freezes it
at ``var_freeze_step``. The freeze must come after ``v`` has settled, and ``v`` settles later than
the learning rate's warm-up ends: on the BERT masked-LM workload of ``recipes/convergence.py`` the
``sqrt(v)`` of the attention query and key weights grows many-fold for a long while after the
warm-up, far more than any other tensor's, and a ``v`` frozen at the end of the warm-up makes their
steps far too large. The rule here is the later of the end of the LR warm-up and
:data:`FREEZE_PERCENT` % of the run (DeepSpeed's 1-bit Adam tutorial advises 15-25% from the
paper's BERT runs; short runs need the later end, see ``docs/convergence.md``).

0/1 Adam's local phase (from ``var_freeze_step`` to the end) syncs with a gap that starts at 1
and doubles every ``local_step_scaler`` steps up to ``local_step_clipper``.
:func:`recommended_local_steps` lets the gap reach its largest value a quarter of the way into the
local phase, and keeps that largest gap to at most ``1 / LOCAL_PHASE_SYNCS`` of the phase, so a
short run still syncs often (on a short fine-tuning run, the paper's gap of 16 costs 0/1 Adam
accuracy). Runs whose local phase has 1,024 steps or more keep the paper's 16.
"""

from __future__ import annotations

import math

__all__ = ["FREEZE_PERCENT", "LOCAL_PHASE_SYNCS", "recommended_freeze_step", "recommended_local_steps"]

#: the earliest point of the run, in percent of its steps, at which the variance is frozen
FREEZE_PERCENT = 30
#: the largest sync gap is at most this fraction (1 / LOCAL_PHASE_SYNCS) of 0/1 Adam's local phase
LOCAL_PHASE_SYNCS = 64


def _check_steps(name: str, value: int, minimum: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} ({what}), got {value!r}")


def recommended_freeze_step(num_training_steps: int, warmup_steps: int = 0) -> int:
    """``max(warmup_steps, ceil(FREEZE_PERCENT / 100 * num_training_steps))``, at least 1.

    Use it for 1-bit Adam's ``freeze_step`` with your LR warm-up, and for 0/1 Adam's
    ``var_freeze_step`` with twice your LR warm-up (what ``ZeroOneTrainer`` derives)::

        OneBitAdam(params, lr=1e-3, freeze_step=recommended_freeze_step(10_000, warmup_steps=500))
        ZeroOneAdam(params, lr=1e-3, var_freeze_step=recommended_freeze_step(10_000, warmup_steps=2 * 500))
    """
    _check_steps("num_training_steps", num_training_steps, 1, "optimizer steps")
    _check_steps("warmup_steps", warmup_steps, 0, "the LR warm-up's steps")
    return max(1, warmup_steps, -(-num_training_steps * FREEZE_PERCENT // 100))


def recommended_local_steps(
    num_training_steps: int, var_freeze_step: int, local_step_clipper: int | None = None
) -> dict[str, int]:
    """0/1 Adam's ``local_step_scaler`` and ``local_step_clipper`` for a run of ``num_training_steps``.

    With ``L = num_training_steps - var_freeze_step`` local-phase steps: the largest gap is
    ``local_step_clipper`` (when ``None``: 16, the paper's :math:`H`, but at most
    ``L // LOCAL_PHASE_SYNCS`` rounded down to a power of two, and at least 1: no local steps),
    and the gap doubles every
    ``L // (4 * doublings)`` steps, so it reaches that largest gap a quarter of the way into the
    local phase. An explicit ``local_step_clipper`` is kept as given. What ``ZeroOneTrainer``
    derives; for the bare optimizer::

        var_freeze = recommended_freeze_step(10_000, warmup_steps=2 * 500)
        ZeroOneAdam(params, lr=1e-3, var_freeze_step=var_freeze, **recommended_local_steps(10_000, var_freeze))
    """
    _check_steps("num_training_steps", num_training_steps, 1, "optimizer steps")
    _check_steps("var_freeze_step", var_freeze_step, 0, "the first step of the local phase")
    local = max(0, num_training_steps - var_freeze_step)
    if local_step_clipper is None:
        largest = max(1, min(16, local // LOCAL_PHASE_SYNCS))
        local_step_clipper = 2 ** (largest.bit_length() - 1)  # a power of two: the gap doubles up to it
    _check_steps("local_step_clipper", local_step_clipper, 1, "the largest sync gap")
    doublings = max(1, math.ceil(math.log2(local_step_clipper)))  # a clipper of 1: no local steps
    return {"local_step_scaler": max(1, local // (4 * doublings)), "local_step_clipper": local_step_clipper}
