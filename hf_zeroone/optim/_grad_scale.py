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

from typing import Any

import torch
from torch import Tensor

__all__ = ["factor", "sample"]

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
