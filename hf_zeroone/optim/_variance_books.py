"""The variance's books: bias corrections and the denominators ``sqrt(v / c2) + eps`` of each step kind.

:class:`VarianceBooks` is a part of :class:`~._books.OptimizerBooks` (a base class of it): it reads
the optimizer's schedule, state and settings, and computes, per parameter group, what the update,
the clipping to the variance and the messages' units divide by. ``follow_gradient_scale``'s factor
enters here (:mod:`._grad_scale`), and a frozen variance's denominators are computed once per step
(:mod:`._variance_views`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hf_zeroone.optim import _functional as F
from hf_zeroone.optim import _grad_scale
from hf_zeroone.optim._step_kind import StepKind
from hf_zeroone.optim._variance_views import SampleStatistics

__all__ = ["VarianceBooks"]


class VarianceBooks:
    """Bias corrections and denominators of the optimizer's variance (see the module)."""

    def _coefficients(self, group: dict[str, Any], kind: StepKind, step: int | None = None) -> tuple[float, float]:
        """``(c1, c2)``: bias corrections of m and v for the coming step, or step ``step`` (1 when disabled)."""
        if not group["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = group["betas"]
        t = self.schedule["step"] + 1 if step is None else step
        k = self.variance_steps() + (self._variance_gap() if kind is StepKind.EXACT else 0)
        c2 = 1.0 - beta2**k if k > 0 else 1.0
        return 1.0 - beta1**t, c2

    def _denominators(
        self,
        group: dict[str, Any],
        params: Sequence[Tensor],
        kind: StepKind,
        c2: float,
    ) -> list[Tensor]:
        """``sqrt(v / c2) + eps``; after the freeze ``v`` follows the gradient's scale (:mod:`._grad_scale`).

        Inside ``step()``, a frozen variance's denominators are computed once and reused by the
        clipping, the update and a sync (``v`` and the scale do not change within the step).
        """
        cache = getattr(self, "_step_denominators", None)
        if cache is None or kind is StepKind.EXACT:
            return self._compute_denominators(group, params, kind, c2)
        whole = cache.get((id(params[0]), len(params), kind, c2)) if params else None
        if whole is not None and len(whole[0]) == len(params) and all(map(operator.is_, whole[0], params)):
            return list(whole[1])  # the same list again (the update after the clipping, a sync)
        missing = [p for p in params if (id(p), kind, c2) not in cache]
        if missing:
            fresh = self._compute_denominators(group, missing, kind, c2)
            cache.update(((id(p), kind, c2), d) for p, d in zip(missing, fresh))
        dens = [cache[(id(p), kind, c2)] for p in params]
        if params:
            cache[(id(params[0]), len(params), kind, c2)] = (list(params), list(dens))
        return dens

    def _compute_denominators(
        self, group: dict[str, Any], params: Sequence[Tensor], kind: StepKind, c2: float
    ) -> list[Tensor]:
        factors = self.scale_factors(group, params) if kind.frozen_variance else None
        v = [self.state[p]["exp_avg_sq"] for p in params]
        if (
            factors is None
            or (not isinstance(factors, Tensor) and all(f is None for f in factors))
            or not all(t.dtype == torch.float32 for t in v)
            or not self._plain_denominators_follow(kind)
        ):
            dens = F.denominators(v, c2, group["eps"], factors)
        else:
            # This step will measure its scale samples against the plain denominators, sqrt(v / c2) + eps:
            # one sqrt(v) for both (the plain ones kept in variance_views, where they are looked up)
            plain, dens = F.split_denominators(v, c2, group["eps"], factors)
            self.variance_views.offer(params, v, c2, group["eps"], plain)
        return dens

    def _plain_denominators_follow(self, kind: StepKind) -> bool:
        """Whether, inside ``step()``, this step's scale samples are still to be taken from local gradients.

        They are on local steps and syncs (after the update, which asks for the scaled
        denominators first), and on 1-bit steps of one process when clipping asks for the scaled
        ones before the samples (without clipping the samples come first, and the update's request
        would make a plain set nobody reads). Several processes take a 1-bit step's samples
        beside its message, whose chain computes both sets itself (:mod:`._onebit_messages`);
        outside ``step()`` (a sync of ``synchronize()``) nothing would release what was kept.
        """
        if getattr(self, "_step_denominators", None) is None or not self.follow_gradient_scale:
            return False
        if kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC):
            return True
        return kind.compressed and self.clip_to_variance and not self.comm.is_distributed

    def scale_factors(self, group: dict[str, Any], params: Sequence[Tensor]) -> Tensor | list[Tensor | None] | None:
        """``follow_gradient_scale``'s factor ``f`` of a frozen ``v`` per parameter (``None``: the option is off).

        A vector when every parameter has one, else a list with ``None`` where one has none.

        The denominators of a frozen variance are ``sqrt(v f / c2) + eps`` (:mod:`._grad_scale`).
        """
        if not self.follow_gradient_scale:
            return None
        factors = _grad_scale.factors(
            [self.state[p] for p in params],
            group["betas"][1],
            self.variance_steps(),
            self.schedule.get("scale_samples", 0),
            group["bias_correction"],
        )
        if not self.clip_to_variance:  # unclipped samples: v may only shrink (see ._grad_scale)
            if isinstance(factors, Tensor):
                return factors.clamp(max=1.0)
            factors = [None if f is None else f.clamp(max=1.0) for f in factors]
        return factors

    def plain_denominators(
        self, group: dict[str, Any], params: Sequence[Tensor], c2: float
    ) -> tuple[list[Tensor], SampleStatistics]:
        """``sqrt(v / c2) + eps`` of ``params`` (one group's) and their statistics, reused while ``v`` stands.

        Without ``follow_gradient_scale``'s factor: what the update-unit weights and the scale
        samples measure against (:mod:`._variance_views`). Once ``v`` has had an update, an element
        whose ``v`` is still zero takes no part in the samples (:func:`._grad_scale.idle_floors`);
        before, every ``v`` is zero, and the first exact step's two samples for ``rho`` measure
        against ``eps`` alike: their ratio does not depend on it.
        """
        idle_eps = group["eps"] if self.schedule["variance_updates"] > 0 else 0.0
        v = [self.state[p]["exp_avg_sq"] for p in params]
        return self.variance_views.statistics(params, v, c2, group["eps"], idle_eps)

    def variance_steps(self) -> int:
        """The steps the variance stands for: its updates, each counted for the steps since the one before.

        Equal to the number of updates when every step up to the freeze updates ``v`` (1-bit Adam).
        0/1 Adam updates it sparsely; an update after a gap of ``k`` steps is weighted as Adam's
        ``k`` updates of the same gradient would be, ``v <- beta2^k v + (1 - beta2^k) g^2``, and the
        bias correction is ``1 - beta2^variance_steps``. ``v_hat`` is then Adam's average of ``g^2``
        over *time*. Counted as one step each (the paper's and DeepSpeed's rule), the dense samples
        of the first gaps outweigh the later ones: when the gradient's scale falls over the phase,
        the frozen ``v_hat`` ends well above Adam's (``tests/test_zeroone_time_weighting.py``).
        """
        return self.schedule["variance_steps"]

    def _variance_gap(self) -> int:
        """The steps a variance update made now stands for (1 unless the schedule skips variance updates)."""
        return 1

    def _variance_correction(self, group: dict[str, Any]) -> float:
        """``c2`` of the variance as it stands (before this step's update, if it makes one)."""
        k = self.variance_steps()
        return 1.0 - group["betas"][1] ** k if group["bias_correction"] and k > 0 else 1.0
