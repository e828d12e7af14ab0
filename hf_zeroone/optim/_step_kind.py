"""Step kinds of the compressed optimizers (see :mod:`hf_zeroone.optim._base`) and argument checks."""

from __future__ import annotations

import enum
from typing import Any

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
    def message_is_gradient(self) -> bool:
        """True when a rank's message is its raw gradient (what DDP's bucket already holds)."""
        return self in (StepKind.EXACT, StepKind.ONEBIT_GRADIENT)


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
