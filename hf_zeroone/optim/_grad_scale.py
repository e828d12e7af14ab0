r"""``follow_gradient_scale`` (on by default): a frozen variance that follows the gradient's scale.

Both optimizers freeze ``v``; Adam's would go on following the gradients. When their scale keeps
falling after the freeze (least squares) the frozen ``v`` is too large and the steps too small,
several times above AdamW's final loss even in one process (``docs/stale_variance.md``); when it
grows (a language model leaving its first plateau) ``v`` is too small and the steps too large.

With the option, each tensor keeps the element-wise *shape* of its frozen ``v`` and rescales it,
by a factor ``f``, to what Adam's ``v`` would have become on average over the tensor's elements.
If Adam had gone on updating ``v`` after its last update, at step ``K`` (bias correction ``c_k = 1 -
beta2^k``; ``K`` counts the steps the variance stands for, which 0/1 Adam's sparse updates make
more than its updates), then after ``n`` more steps, for each element,

.. math::

    \frac{\hat v_{K+n}}{\hat v_K} = \frac{c_K}{c_{K+n}} \Big(\beta_2^n + (1 - \beta_2) \sum_{i=1}^{n}
    \beta_2^{n-i} \frac{g_{K+i}^2}{c_K \hat v_K}\Big),

so averaged over the tensor, with ``q_i`` the mean of ``g^2 / (sqrt(v_hat_K) + eps)^2`` over its
elements (:func:`scale_samples`), ``f = (c_K / c_{K+n}) G_n`` where ``G_0 = 1`` and
``G_i = beta2 G_{i-1} + (1 - beta2) q_i / c_K``: one float per tensor, exact for the mean ratio, and
equal to 1 while the gradients keep the scale ``v`` had (``bias_correction=False``: ``c = 1``).
``G`` restarts at 1 at every variance update, so no reference from before the freeze enters it.

Where the samples come from:

* 1-bit Adam's compressed steps: each rank's local gradient, averaged over ranks in the exact lane
  of the step's collectives. A local gradient is noisier than the average Adam's ``v`` followed, so
  the sample is divided by that excess, ``rho``: the ratio of the local samples to the sample of
  the averaged gradient, measured on the exact steps before the freeze (both are at hand there)
  and averaged like ``v`` (:class:`GradientScale`; 1 in one process).
* 0/1 Adam's 1-bit gradient steps, between its sparse variance updates: as 1-bit Adam's.
* 0/1 Adam's local steps: the rank's own local gradient, divided by ``rho`` too (the sync averages
  the local steps, whose noise then averages out as the exact average's did). Each rank sums its
  samples until the next sync, whose exact lane averages the sums over ranks; ``G`` moves then,
  by ``k`` steps at once, so every replica keeps the same ``G``: the same denominators, and the
  same momentum after the sync, which re-estimates it from them.

Each sample is reduced by the fraction of the gradient's norm that clipping kept. Elements whose
``sqrt(v) + eps`` is below a tenth of their tensor's mean take no part (:data:`IDLE_BELOW`): their
variance is next to nothing (an attention key bias, whose gradient is zero; a token not seen yet)
and, measured against it, one gradient that wakes such an element up would count for thousands of
the others. ``f`` may grow or shrink; with ``clip_to_variance=False`` it is capped at 1 (``v`` may
only shrink), since without the clip nothing bounds what a woken element's gradient adds to the
samples.

Until the freeze (and whenever the option is off) the factor is not applied at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hf_zeroone._runs import per_piece
from hf_zeroone._tensors import host_index, in_order, moved, mul_scalar_, picked, rows_by_group, shape_groups, tiling
from hf_zeroone.optim import _functional as F
from hf_zeroone.optim._scalar_vectors import Noted, adopt, as_vector, read_vector
from hf_zeroone.optim._step_kind import StepKind

__all__ = ["GradientScale", "factors", "kept_fraction", "sample_statistics", "scale_samples"]

_G, _R, _P = "grad_scale", "noise_excess", "scale_pending"
#: state entries of this module (float32 scalars, kept float32 through checkpoints)
STATE_KEYS = (_G, _R, _P)
#: retired state entries that older checkpoints may hold, dropped on load (the scale restarts at 1)
LEGACY_KEYS = ("grad_sq", "grad_sq_ref")
#: elements whose ``sqrt(v) + eps`` is below this fraction of their tensor's mean take no part in
#: its samples (see :func:`scale_samples`)
IDLE_BELOW = 0.1
#: the smallest normal float32: an averaged sample of zero divides as this
_TINY = torch.finfo(torch.float32).tiny


def _correction(beta2: float, updates: int, bias_correction: bool) -> float:
    return 1.0 - beta2**updates if bias_correction and updates > 0 else 1.0


def factors(
    states: Sequence[dict[str, Any]], beta2: float, variance_steps: int, samples: int, bias_correction: bool
) -> Tensor | list[Tensor | None]:
    """``f = (c_K / c_{K+n}) G`` of each tensor (the module docstring); ``None`` where there is no ``G``.

    ``variance_steps`` is ``K`` (the steps the variance stands for, see
    :meth:`~hf_zeroone.optim.CompressedAdamBase.variance_steps`), ``samples`` is ``n``. One vectorised
    computation for all tensors (their ``G`` are one vector, see :mod:`._scalar_vectors`), returned
    as that vector when every tensor has a ``G``, else as a list.
    """
    out: list[Tensor | None] = [None] * len(states)
    have = [i for i, st in enumerate(states) if _G in st]
    if not have or variance_steps == 0:
        return out
    ratio = _correction(beta2, variance_steps, bias_correction) / _correction(
        beta2, variance_steps + samples, bias_correction
    )
    values = read_vector([states[i] for i in have], _G) * ratio
    if len(have) == len(states):
        return values
    for i, value in zip(have, values.unbind()):
        out[i] = value
    return out


def norm_left(after: Tensor, handed: Tensor) -> Tensor:
    """The norms clipping left over the norms handed on (float32 vectors or 0-dim): 1 where nothing was handed on.

    A zero gradient (a tensor the loss does not reach) hands on a zero norm, and 0/0 would make its
    samples, and its denominators, NaN. Equal norms give 1, infinite ones too (a float32 norm
    overflows on elements of about ``1e19 / sqrt(n)``, where Adam's arithmetic still holds).
    """
    return torch.where((handed > 0) & (after != handed), after / torch.where(handed > 0, handed, 1.0), 1.0)


def kept_fraction(ratio: Tensor) -> Tensor:
    """The fraction of a gradient's norm that clipping kept: exactly 1 unless it was cut.

    ``ratio`` is the norm after clipping over the norm handed on; two norms of the same values
    can differ in the last bit (a different summation order), which must not count as clipping.
    """
    return torch.where(ratio > 1.0 - 1e-5, torch.ones_like(ratio), ratio)


def idle_floors(means: Tensor, eps: float = 0.0) -> Tensor:
    """The smallest ``d`` of an active element, per tensor: :data:`IDLE_BELOW` of its mean, and above ``eps``.

    ``d = sqrt(v / c2) + eps`` is ``eps`` itself where ``v`` is zero: an element with no variance
    estimate expects no gradient, so measured against it any gradient counts as infinitely large.
    A tensor whose ``v`` is zero everywhere (no gradient before the freeze: a layer switched on
    later, an unfrozen backbone) would otherwise count all its elements active, and its first
    gradient would count as ``(g / eps)^2``: a factor of 1e15 on ``v``, which would have held its
    steps near zero for tens of thousands of steps.
    """
    floors = means * IDLE_BELOW
    if eps > 0.0:  # the next float32 above eps: d == eps is idle
        above = float(np.nextafter(np.float32(eps), np.float32(math.inf)))  # no tensor: no host read
        floors = floors.clamp(min=above)
    return floors


def sample_statistics(dens: Sequence[Tensor], eps: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Per tensor: the mean of its denominators ``d``, the count of its active elements, whether any is idle.

    An element is active when its ``d`` is at least :data:`IDLE_BELOW` of its tensor's mean, and
    above ``eps`` (:func:`idle_floors`; see :func:`scale_samples`). Returns float32 means, float32
    counts (at least 1) and a boolean vector (compared on the exact integer counts), all on the
    device: nothing is read on the host. They stay while ``v`` does
    (:class:`._variance_views.VarianceViews` keeps them).
    """
    dens = list(dens)
    numels = torch.tensor([d.numel() for d in dens], device=dens[0].device)
    span, reverse = tiling(dens)  # flat state's: a reduction per run of its pieces (the same bits), where they run
    l1 = None if span is None else per_piece(lambda d: torch.linalg.vector_norm(d, 1, dim=1), span, dens, reverse)
    # one division for all tensors, as each alone (a count converts to float32 as a Python int would)
    means = (torch.stack(torch._foreach_norm(dens, 1)) if l1 is None else l1) / numels.clamp(min=1).to(torch.float32)
    floors = idle_floors(means, eps)
    counts = None if l1 is None else per_piece(_at_least, span, dens, reverse, floors)
    counts = _active_counts(dens, floors) if counts is None else counts
    idle = counts < numels
    return means, counts.to(torch.float32).clamp_(min=1.0), idle


def _at_least(rows: Tensor, floors: Tensor) -> Tensor:
    return rows.ge(floors[:, None].to(rows.dtype)).sum(1)  # each row's count, compared in d's dtype


def _active_counts(dens: list[Tensor], floors: Tensor) -> Tensor:
    """Per tensor, how many of its ``d`` are at least its floor (int64), in ``d``'s dtype: a call per shape."""
    parts = []
    groups = shape_groups(dens, range(len(dens)))
    for group, rows in zip(groups, rows_by_group(floors, groups)):
        stacked = torch.stack([dens[i] for i in group])
        active = stacked.ge(rows.view(-1, *([1] * (stacked.dim() - 1))).to(stacked.dtype))
        parts.append((group, active.reshape(len(group), -1).sum(1)))  # 0-dim parameters: one element
    return in_order(parts, len(dens))


def scale_samples(
    grads: Sequence[Tensor],
    dens: Sequence[Tensor],
    means: Tensor,
    counts: Tensor,
    idle: Sequence[bool] | None,
    eps: float = 0.0,
) -> Tensor:
    """``q``: each gradient's mean square once normalised by the variance, as one float32 vector.

    The mean of ``(g_j / d_j)^2``, ``d = sqrt(v / c2) + eps``, over the elements whose ``d_j`` is
    at least :data:`IDLE_BELOW` of their tensor's mean (``means``; ``counts`` of them, from
    :func:`sample_statistics`): how large the gradient is *relative to* what ``v`` expects,
    element by element, so that a few elements with large gradients do not speak for the whole
    tensor, and elements with next to no variance do not either. ``idle``: per tensor, whether
    any element is inactive (``None``: unknown, every tensor is masked). The tensors are one
    parameter group's.
    """
    grads, dens = F.as_dtype(grads, torch.float32), list(dens)
    if not dens:
        return torch.zeros(0, dtype=torch.float32, device=means.device)
    if idle is not None and not any(idle):  # no element to leave out: one multi-tensor call each
        return torch.stack(torch._foreach_norm(torch._foreach_div(grads, dens))).square_().div_(counts)
    # Otherwise a call per shape (shape_groups); a tensor with no idle element: nothing masked, the same bits
    parts = []  # (indices, the norms of g / d)
    groups = shape_groups(dens, range(len(dens)))
    for group, rows in zip(groups, rows_by_group(idle_floors(means, eps), groups)):
        stacked_dens = torch.stack([dens[i] for i in group])
        stacked = torch.stack([grads[i] for i in group])  # divided in the promoted dtype, as the unmasked ones
        stacked = stacked.div_(stacked_dens) if stacked.dtype == stacked_dens.dtype else stacked / stacked_dens
        thresholds = rows.view(-1, *([1] * (stacked_dens.dim() - 1))).to(stacked_dens.dtype)
        stacked.masked_fill_(stacked_dens < thresholds, 0.0)  # compared in d's dtype, as against a 0-dim floor
        parts.append((group, torch.linalg.vector_norm(stacked.reshape(len(group), -1), dim=1)))
    return in_order(parts, len(grads)).square_().div_(counts)


class GradientScale:
    """The samples of ``follow_gradient_scale``, noted by whoever combined the gradients, and their folding.

    ``step()`` or the DDP hook :meth:`record` each tensor's sample (for 1-bit momentum: the mean over
    ranks of the local samples, with the norm handed on as ``p.grad``); on exact steps of several
    ranks also the sample of the averaged gradient (:meth:`record_averaged`), for the noise excess
    ``rho``; the 1-bit momentum step notes the fraction of the gradient that clipping kept
    (:meth:`note_kept`). ``step()`` then folds them into each tensor's state (:meth:`fold`).
    """

    def __init__(self) -> None:
        #: per parameter: its sample
        self.samples = Noted()
        #: per parameter: the sample of the averaged gradient (exact steps of several ranks)
        self.averaged = Noted()
        #: per parameter: the fraction of the implied gradient's norm that clipping kept this step
        self.kept = Noted()

    def record(self, params: Sequence[Tensor], samples: Tensor) -> None:
        self.samples.note(params, samples)

    def record_averaged(self, params: Sequence[Tensor], samples: Tensor) -> None:
        self.averaged.note(params, samples)

    def note_kept(self, params: Sequence[Tensor], fractions: Tensor) -> None:
        self.kept.note(params, fractions)

    def fold(
        self,
        kind: StepKind,
        groups: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]],
        state_of,  # noqa: ANN001
        schedule: dict[str, Any],
        enabled: bool,
        local_samples,  # noqa: ANN001 - (group, params, values) -> this rank's samples (local steps)
        gap: int = 1,
    ) -> None:
        """Fold this step's samples into each tensor's ``G`` (and, on exact steps, ``rho``).

        Exact steps update ``v``: ``G`` restarts at 1. Local steps add their samples to each
        tensor's ``scale_pending``; the next sync pools them over ranks (:meth:`fold_pending`), so
        that every replica keeps the same ``G``. ``groups``: the step's ``(group, params, values)``.
        """
        samples, self.samples = self.samples, Noted()
        averaged, self.averaged = self.averaged, Noted()
        kept_fractions, self.kept = self.kept, Noted()
        if not enabled:
            return
        if kind is StepKind.EXACT:
            self._restart(groups, state_of, schedule, samples, averaged, gap)
            return
        if schedule["variance_updates"] == 0:
            return  # no variance yet to compare with
        local = kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC)
        for group, params, values in groups:
            if local:  # this rank's own gradient, as its local step used it: pooled at the next sync
                states = [state_of(p) for p in params]
                if not all(_G in st for st in states):
                    chosen = [i for i, st in enumerate(states) if _G in st]
                    params, values = [params[i] for i in chosen], [values[i] for i in chosen]
                    states = [states[i] for i in chosen]
                if not params:
                    continue
                q = local_samples(group, params, values).to(torch.float32)
                if not any(_P in st for st in states):  # the first local step since a sync: q itself
                    adopt(states, _P, q.clone())
                    continue
                if not all(_P in st for st in states):
                    zero = torch.zeros((), dtype=torch.float32, device=q.device)
                    adopt(states, _P, torch.stack([st.get(_P, zero) for st in states]))
                as_vector(states, _P).add_(q)
                continue
            scaled = [p for p in params if _G in state_of(p)]
            positions, q = samples.gather(scaled)
            if not positions:
                continue
            taken = [scaled[i] for i in positions]
            q = q.to(device=taken[0].device, dtype=torch.float32)
            clipped, kept = kept_fractions.gather(taken)
            if clipped:  # the samples of gradients that clipping cut, by the square of what it kept
                factor = moved(kept, q.device)
                if clipped != list(range(len(taken))):
                    factor = torch.ones_like(q).index_copy_(0, host_index(clipped, q.device), factor)
                q = q * factor.square()
            self._update(group, [state_of(p) for p in taken], q, schedule, steps=1)
        if local:
            schedule["scale_pending_steps"] = schedule.get("scale_pending_steps", 0) + 1
        schedule["scale_samples"] = schedule.get("scale_samples", 0) + 1

    def fold_pending(
        self,
        groups: list[tuple[dict[str, Any], list[Tensor], Tensor]],
        state_of,
        schedule: dict[str, Any],  # noqa: ANN001
    ) -> None:
        """At a sync: the local samples since the last one, summed per rank and averaged over ranks, into ``G``.

        ``groups``: ``(group, params, summed samples)``, a vector identical on every rank. ``k`` local
        steps with the same mean sample ``q`` give ``G <- beta2^k G + (1 - beta2^k) q``.
        """
        steps = schedule.get("scale_pending_steps", 0)
        for group, params, sums in groups:
            states = [state_of(p) for p in params]
            for st in states:
                st.pop(_P, None)
            keep = [i for i, st in enumerate(states) if _G in st]
            if steps and keep:
                q = picked(sums, keep).to(torch.float32) / steps
                self._update(group, [states[i] for i in keep], q, schedule, steps=steps)
        schedule["scale_pending_steps"] = 0

    @staticmethod
    def pending(states: Sequence[dict[str, Any]], like: Tensor) -> Tensor:
        """This rank's local samples summed since the last sync (zero where none), one float32 vector."""
        if all(_P in st for st in states):
            return read_vector(states, _P)
        zero = torch.zeros((), dtype=torch.float32, device=like.device)
        return torch.stack([st.get(_P, zero) for st in states])

    @staticmethod
    def noise_excess(states: Sequence[dict[str, Any]], beta2: float, schedule: dict[str, Any]) -> Tensor | None:
        """``rho`` of each tensor (bias-corrected, float32): how much a local sample exceeds the averaged one.

        Measured on the exact steps of several ranks before the freeze (:meth:`_restart`); ``None``
        unless every tensor of ``states`` has it (one rank, the option off, or no such step yet).
        """
        noise = schedule.get("noise_samples", 0)
        if not noise or not states or not all(_R in st for st in states):
            return None
        return read_vector(states, _R) / (1.0 - beta2**noise)

    @staticmethod
    def _update(
        group: dict[str, Any], states: list[dict[str, Any]], q: Tensor, schedule: dict[str, Any], steps: int
    ) -> None:
        """``G <- beta2^k G + (1 - beta2^k) q / (rho c_K)`` for ``k = steps`` steps of mean sample ``q``."""
        beta2 = group["betas"][1]
        rho = GradientScale.noise_excess(states, beta2, schedule)
        if rho is not None:  # a local gradient is noisier than the average
            q = q / rho.to(q.device)
        q = q / _correction(beta2, schedule["variance_steps"], group["bias_correction"])
        decay = beta2**steps
        current = as_vector(states, _G)  # every tensor's G, as one vector (see ._scalar_vectors)
        mul_scalar_([current], decay)
        current.add_(q, alpha=1.0 - decay)

    @staticmethod
    def _restart(groups, state_of, schedule, samples, averaged, gap=1) -> None:  # noqa: ANN001
        """A variance update: every ``G`` back to 1; with both samples at hand, one more ``rho`` sample."""
        schedule["scale_samples"] = 0
        noise = schedule.get("noise_samples", 0)
        measured = False
        for group, params, _ in groups:
            beta2 = group["betas"][1]
            states = [state_of(p) for p in params]
            if states and all(_G in st for st in states):  # back to 1 in place
                as_vector(states, _G).fill_(1.0)
            elif len({p.device for p in params}) == 1:
                adopt(states, _G, torch.ones(len(states), dtype=torch.float32, device=params[0].device))
            else:  # a group over several devices: each G on its parameter's (not one vector)
                for p, st in zip(params, states):
                    st[_G] = torch.ones((), dtype=torch.float32, device=p.device)
            local_at, local = samples.gather(params)
            paired, averaged_samples = averaged.gather([params[i] for i in local_at])  # positions in local_at
            if paired:  # rho <- decay rho + (1 - decay) local / averaged, as one vector for all tensors
                device = params[local_at[paired[0]]].device
                local = moved(picked(local, paired), device)
                ratio = local / moved(averaged_samples, device).clamp(min=_TINY)
                both = [(params[local_at[j]], states[local_at[j]]) for j in paired]
                # no measurement, no excess (1): where there is no gradient anywhere (a tensor the
                # loss does not reach; 0 would divide later samples into 0/0, and a local sample is
                # never below the averaged one: the mean of squares bounds the square of the mean),
                # and where both samples overflowed (inf / inf: gradients above ~1e11 measured
                # against the first step's v = 0), since one NaN would stay in rho's average forever
                ratio = torch.where((local > 0) & torch.isfinite(ratio), ratio, torch.ones_like(ratio))
                zero = torch.zeros((), dtype=torch.float32, device=device)
                r = torch.stack([st.get(_R, zero) for _, st in both])
                decay = beta2**gap
                adopt([st for _, st in both], _R, r * decay + ratio.to(torch.float32) * (1.0 - decay))
                measured = True
        if measured:
            schedule["noise_samples"] = noise + gap
