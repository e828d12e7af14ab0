r"""``follow_gradient_scale`` (on by default): a frozen variance that follows the gradient's scale.

1-bit Adam freezes ``v`` at ``freeze_step`` and 0/1 Adam at ``var_freeze_step``. Adam's ``v``
would go on following the gradients; when their scale keeps falling after the freeze (a
regression whose loss falls by orders of magnitude) the frozen ``v`` is too large and the steps
too small. On least squares with a learning rate decaying to 0 that leaves 1-bit and 0/1 Adam 3x
and 5x above AdamW's final loss, in a single process, with no compression at all.

With the option, each tensor keeps the element-wise *shape* of its frozen ``v`` and rescales it by
how large its gradients have become relative to it:

.. math::

    q_t = \frac{1}{n} \overline{\sum_j \frac{g_{ij,t}^2}{(\sqrt{\hat v_j} + \epsilon)^2}}
    \ \text{(mean over ranks, exact)}, \qquad
    S \leftarrow \beta_2 S + (1 - \beta_2)\, q_t, \qquad
    \hat v_t^{\text{used}} = \hat v \cdot \min\Big(1, \frac{S_t / c_S(t)}{S_f / c_S(f)}\Big),

over the elements with ``v_j > 0``, with ``f`` the last variance update (``v`` as it was before
that step) and ``c_S`` the bias correction of ``S`` (``1`` when ``bias_correction`` is off). One
float per tensor is averaged per step: on the collective 1-bit Adam already makes for its
gradient-sized norms, and in one small extra allreduce on exact steps. In 0/1 Adam's local phase
each rank folds in its own local gradient (nothing is sent; the sync sets every replica to
``delta p_s - mean u`` whatever the denominators were). 0/1 Adam's 1-bit gradient steps do not
sample, as they do not update ``v``. Each sample is reduced by the fraction of the gradient's norm
that clipping kept. The factor is capped at 1: ``v`` may shrink, never grow.

Why normalised by ``v`` and capped: the plain mean square of a tensor's gradient speaks for its
few largest elements, and an uncapped ratio of normalised squares is driven by the elements whose
``v`` happened to be tiny at the freeze (factors of 1000 on some GPT-2 tensors).

Why it is on by default: it fixes least squares (``tests/test_convergence_defaults.py``), and
with the variance frozen no earlier than a fifth of the run (:mod:`hf_zeroone.optim._schedule`)
it does not cost the language models of ``recipes/convergence.py``; see the README for the
figures. An earlier test, with the freeze at the end of a 10% warm-up, found it cost the MLM run
(+6.1% over AdamW against +4.35% without): the cap keeps ``v`` from growing where attention's
query and key gradients are still growing, which a later freeze avoids.

Until the freeze (and whenever the option is off) the factor is not applied at all: the steps
are bit for bit those of before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hf_zeroone.optim._step_kind import StepKind

__all__ = ["GradientScale", "factor", "kept_fraction", "sample", "scale_samples"]

_S, _REF = "grad_sq", "grad_sq_ref"
#: state entries of this module (float32 scalars, kept float32 through checkpoints)
STATE_KEYS = (_S, _REF)


def _scalar(state: dict[str, Any], key: str, like: Tensor) -> Tensor:
    if key not in state:
        state[key] = torch.zeros((), dtype=torch.float32, device=like.device)
    return state[key]


def _correction(beta2: float, updates: int, bias_correction: bool) -> float:
    return 1.0 - beta2**updates if bias_correction and updates > 0 else 1.0


def sample(
    state: dict[str, Any],
    p: Tensor,
    mean_sq_norm: Tensor,
    kept: Tensor | float,
    beta2: float,
    updates: int,
    bias_correction: bool,
    variance_step: bool,
) -> None:
    """Fold one step's ``q = mean_sq_norm * kept^2 / n`` into ``S`` (``updates`` counts it).

    On a ``variance_step`` (``v`` was updated too) the reference becomes the new ``S / c_S``.
    """
    s = _scalar(state, _S, p)
    if isinstance(kept, Tensor):
        kept = kept.to(device=s.device, dtype=torch.float32)
    q = mean_sq_norm.to(device=s.device, dtype=torch.float32) * kept * kept
    s.mul_(beta2).add_(q / max(p.numel(), 1), alpha=1.0 - beta2)
    if variance_step:
        _scalar(state, _REF, p).copy_(s / _correction(beta2, updates, bias_correction))


def factor(state: dict[str, Any], beta2: float, updates: int, bias_correction: bool) -> Tensor | None:
    """``(S / c_S) / reference`` for the denominator, or ``None`` before any reference exists.

    A tensor whose reference is zero (it never had a gradient before the freeze) keeps factor 1.
    """
    ref = state.get(_REF)
    if ref is None:
        return None
    current = state[_S] / _correction(beta2, updates, bias_correction)
    return torch.where(ref > 0, current / torch.where(ref > 0, ref, torch.ones_like(ref)), torch.ones_like(ref))


def kept_fraction(ratio: Tensor) -> Tensor:
    """The fraction of a gradient's norm that clipping kept: exactly 1 unless it was cut.

    ``ratio`` is the norm after clipping over the norm handed on; two norms of the same values
    can differ in the last bit (a different summation order), which must not count as clipping.
    """
    return torch.where(ratio > 1.0 - 1e-5, torch.ones_like(ratio), ratio)


def scale_samples(
    params: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    state_of,  # noqa: ANN001 - Tensor -> its state dict
    group_of,  # noqa: ANN001 - Tensor -> its parameter group
    variance_updates: int,
) -> Tensor:
    """Each local gradient's squared norm once normalised by the current variance, as one float32 vector.

    ``sum_j g_j^2 / (sqrt(v_j / c2) + eps)^2`` over the elements with a variance (``v_j > 0``): how
    large the gradient is *relative to* what ``v`` expects, element by element, so that a few
    elements with large gradients do not speak for the whole tensor. Averaged over ranks, it is the
    sample of this module.
    """
    out = []
    for p, g in zip(params, grads):
        v = state_of(p).get("exp_avg_sq")
        if g is None or v is None:
            out.append(torch.zeros((), dtype=torch.float32, device=p.device))
            continue
        group = group_of(p)
        k = variance_updates
        c2 = 1.0 - group["betas"][1] ** k if group["bias_correction"] and k > 0 else 1.0
        v = v.float()
        normalised = g.float() / v.div(c2).sqrt_().add_(group["eps"])
        out.append(torch.where(v > 0, normalised.square_(), 0.0).sum())
    return torch.stack(out)


class GradientScale:
    """One step's samples of ``follow_gradient_scale``, noted by whoever combined the gradients.

    ``step()`` or the DDP hook :meth:`record` the mean over ranks of :func:`scale_samples` (and the
    norms handed on as ``p.grad``), the 1-bit momentum step notes the fraction of the gradient that
    clipping kept (:meth:`note_kept`), and ``step()`` folds them in before the update (:meth:`fold`).
    """

    def __init__(self) -> None:
        #: per parameter: the mean over ranks of its sample, and the norm handed on as ``p.grad``
        #: (``None``: handed on unclipped)
        self.samples: dict[Tensor, tuple[Tensor, Tensor | None]] = {}
        #: per parameter: the fraction of the implied gradient's norm that clipping kept this step
        self.kept: dict[Tensor, Tensor] = {}

    def record(
        self, params: Sequence[Tensor], mean_sq_norms: Tensor, handed_norms: Sequence[Tensor] | None = None
    ) -> None:
        for i, p in enumerate(params):
            self.samples[p] = (mean_sq_norms[i], None if handed_norms is None else handed_norms[i])

    def note_kept(self, p: Tensor, fraction: Tensor) -> None:
        self.kept[p] = fraction

    def fold(
        self,
        kind: StepKind,
        updates: list[tuple[dict[str, Any], Tensor, Tensor]],
        state_of,  # noqa: ANN001
        group_of,  # noqa: ANN001
        schedule: dict[str, Any],
        enabled: bool,
    ) -> None:
        """Fold this step's gradient scale into each tensor's running mean square (before the update)."""
        samples, self.samples = self.samples, {}
        kept_fractions, self.kept = self.kept, {}
        if not enabled or kind is StepKind.ONEBIT_GRADIENT or schedule["variance_updates"] == 0:
            return  # v is not updated on these steps; before the first update there is no v to compare with
        count = schedule.get("grad_sq_updates", 0) + 1
        schedule["grad_sq_updates"] = count
        for group, p, value in updates:
            if kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC):  # this rank's own gradient, as used
                mean_sq = scale_samples([p], [value], state_of, group_of, schedule["variance_updates"])[0]
                handed = None
            elif p in samples:
                mean_sq, handed = samples[p]
            else:
                continue
            kept: Tensor | float = 1.0
            if p in kept_fractions:
                kept = kept_fractions[p]
            elif handed is not None:  # clipped after the hook handed it on
                norm = torch.linalg.vector_norm(value, dtype=torch.float32)
                kept = kept_fraction(norm / torch.where(handed > 0, handed, 1.0))
            sample(
                state_of(p),
                p,
                mean_sq,
                kept,
                group["betas"][1],
                count,
                group["bias_correction"],
                variance_step=kind is StepKind.EXACT,
            )
