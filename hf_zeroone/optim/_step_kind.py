"""Step kinds of the compressed optimizers, and argument checks.

An optimizer step has a :class:`StepKind` fixed by the optimizer's schedule before backward runs.
Each kind says what every rank contributes (its *message*), how messages are combined across
ranks, and how the combined *result* updates the state:

================  ==================================  =====================  ==========================
kind              message of rank i                   combined by            result is used as
================  ==================================  =====================  ==========================
EXACT             g_i                                 fp32 allreduce (mean)  gradient: m and v
ONEBIT_GRADIENT   g_i                                 1-bit allreduce        gradient: m only
ONEBIT_MOMENTUM   beta1 * m + (1 - beta1) * g_i       1-bit allreduce        new m, as implied gradient
LOCAL             (nothing sent)                      --                     local gradient: m
ONEBIT_SYNC       u, after this step's local update   1-bit allreduce        accumulated update u
================  ==================================  =====================  ==========================

The first three kinds communicate gradient-like messages that are ready when backward ends, so
the DDP hook sends them during backward. ``ONEBIT_SYNC`` is a local step followed by a sync of
``u``; since ``u`` needs this step's (possibly clipped) gradient, it is sent in ``step()``, after
backward and clipping, by every path. Only sync steps (one in up to ``local_step_clipper`` steps
of 0/1 Adam's local phase) lose the overlap with backward.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import Tensor

__all__ = ["StepKind"]


class StepKind(enum.Enum):
    """What one optimizer step communicates (see the module docstring)."""

    EXACT = "exact"
    ONEBIT_GRADIENT = "onebit_gradient"
    ONEBIT_MOMENTUM = "onebit_momentum"
    LOCAL = "local"
    ONEBIT_SYNC = "onebit_sync"

    @property
    def communicates(self) -> bool:
        return self is not StepKind.LOCAL

    @property
    def communicates_in_backward(self) -> bool:
        """True when the message is ready when backward ends (a DDP hook can send it)."""
        return self in (StepKind.EXACT, StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM)

    @property
    def compressed(self) -> bool:
        return self in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM, StepKind.ONEBIT_SYNC)

    @property
    def frozen_variance(self) -> bool:
        """True when ``v`` is not updated this step (its scale then follows the gradients, see ``._grad_scale``)."""
        return self is not StepKind.EXACT


def _check_fraction(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_adam_arguments(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:  # noqa: ANN401
    """Raise ``ValueError`` naming the first of Adam's hyper-parameters that is out of range."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0.0:
        raise ValueError(f"lr must be a float >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    _check_fraction("betas[0]", betas[0])
    _check_fraction("betas[1]", betas[1])
    if not (isinstance(eps, (int, float)) and eps >= 0.0):
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0.0):
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")


def check_adamw_options(owner: str, maximize: bool, capturable: bool, differentiable: bool) -> None:
    """``ValueError`` for a ``torch.optim.AdamW`` option this optimizer cannot honour, with the way around it.

    ``foreach`` and ``fused`` are accepted and change nothing: they choose how AdamW runs its
    arithmetic, and this optimizer's step is always multi-tensor (AdamW's code carries over as it is).
    """
    if maximize:
        raise ValueError(f"{owner} does not support maximize=True; minimise the negated objective instead")
    if capturable:
        raise ValueError(
            f"{owner} does not support capturable=True (CUDA graphs): its steps communicate and change kind "
            "with the schedule; leave it False"
        )
    if differentiable:
        raise ValueError(f"{owner} does not support differentiable=True (its messages are compressed); leave it False")


#: the dtypes an exact step may send its gradients in (``exact_step_dtype``), by name
EXACT_STEP_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}


def check_exact_step_dtype(value: Any) -> torch.dtype | None:  # noqa: ANN401
    """``exact_step_dtype`` as a ``torch.dtype`` (``None`` kept), or ``ValueError`` naming the choices."""
    if value is None:
        return None
    dtype = EXACT_STEP_DTYPES.get(value.removeprefix("torch.")) if isinstance(value, str) else value
    if dtype not in EXACT_STEP_DTYPES.values():
        fp16 = dtype is torch.float16 or str(value).removeprefix("torch.") in ("float16", "half", "fp16")
        raise ValueError(
            f"exact_step_dtype must be torch.float32, torch.bfloat16 or torch.float8_e4m3fn (or their names, or "
            f"None for the gradients' own precision), got {value!r}"
            + ("; float16 is refused: an fp16 sum of gradients can overflow" if fp16 else "")
        )
    return dtype


def check_param_group(group: dict[str, Any], owner: str) -> None:
    """Raise ``ValueError`` for what a compressed optimizer cannot train: sparse or complex parameters, a bad mask,
    or a hyper-parameter out of range (checked as the constructor checks its own, so that a bad value, such as a
    group's ``lr`` as a tensor, fails here and not in the middle of 0/1 Adam's first sync, after the parameters
    have moved).
    """
    try:
        check_adam_arguments(group.get("lr"), group.get("betas"), group.get("eps"), group.get("weight_decay"))
    except ValueError as exc:
        raise ValueError(f"{owner}: in a parameter group, {exc}") from None
    for p in group["params"]:
        if p.is_sparse:
            raise ValueError(f"{owner} does not support sparse parameters")
        if p.is_complex():
            raise ValueError(f"{owner} does not support complex parameters; use torch.view_as_real on them")
    mask = group.get("exp_avg_mask")
    if mask is not None and not isinstance(mask, Tensor):
        raise ValueError("exp_avg_mask must be a tensor broadcastable to every parameter of its group")
