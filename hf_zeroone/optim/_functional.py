r"""The maths of the compressed Adam step, on lists of tensors (one parameter group at a time).

Nothing here holds state or communicates: :class:`~hf_zeroone.optim.CompressedAdamBase` keeps the
books (state, schedule, communicator) and calls these functions, as ``torch.optim.AdamW`` calls
``torch.optim.adam._multi_tensor_adam``. The per-element arithmetic runs in multi-tensor
(``torch._foreach_*``) form, one call for all tensors of a list, so a model with hundreds of
tensors pays a few calls per operation instead of one per tensor.

With :math:`d = \sqrt{v / c_2} + \epsilon` the Adam denominator (:func:`denominators`),
:math:`c_1 = 1 - \beta_1^t`, :math:`c_2 = 1 - \beta_2^k` the bias corrections and :math:`\delta =
1 - \text{lr}\,\text{wd}` the decoupled weight decay, every step kind applies
(:func:`adam_update`)

.. math::

    m \leftarrow \beta_1 m + (1 - \beta_1) g, \quad
    [v \leftarrow \beta_2 v + (1 - \beta_2) g^2 \ \text{on exact steps}], \quad
    p \leftarrow \delta p - \frac{\text{lr}}{c_1} \frac{m}{d},

where ``g`` is what the step's communication produced (see :mod:`hf_zeroone.optim._base`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hf_zeroone._runs import apply_to_pieces, pieces
from hf_zeroone._tensors import (
    add_scalar_,
    apply_per_tensor,
    div_scalar,
    div_scalar_,
    float32_norms,
    moved,
    mul_scalar,
    mul_scalar_,
    per_tensor_in_dtypes,
    scalar_operand,
    tiling,
)

__all__ = [
    "adam_update",
    "divided",
    "by_group",
    "clip_to_variance",
    "denominators",
    "from_update_units",
    "implied_gradients",
    "l2_gradients",
    "local_sq_norms",
    "onebit_message",
    "norm_proxy_factors",
    "root_denominators",
    "split_denominators",
    "to_update_units",
    "variance_bound",
]


def by_group(items: Sequence[tuple[dict, Tensor, Any]]) -> list[tuple[dict, list[Tensor], list[Any]]]:
    """``(group, params, values)`` for each parameter group of ``(group, param, value)`` items, in order.

    The functions below take one group's tensors at a time (they share its hyper-parameters).
    """
    items = list(items)
    if items and all(item[0] is items[0][0] for item in items):  # the common case: one group
        return [(items[0][0], [item[1] for item in items], [item[2] for item in items])]
    out: dict[int, tuple[dict, list[Tensor], list[Any]]] = {}
    for group, p, value in items:
        entry = out.setdefault(id(group), (group, [], []))
        entry[1].append(p)
        entry[2].append(value)
    return list(out.values())


def l2_gradients(grads: Sequence[Tensor], params: Sequence[Tensor], weight_decay: float) -> list[Tensor]:
    """``g + wd * p`` for every pair (new tensors): the gradient of L2 weight decay (not decoupled)."""
    return list(torch._foreach_add(list(grads), list(params), alpha=weight_decay))


def denominators(
    exp_avg_sqs: Sequence[Tensor],
    c2: float,
    eps: float,
    factors: Tensor | Sequence[Tensor | None] | None = None,
    roots: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """``sqrt(v / c2) + eps`` per tensor; with a factor ``f``: ``sqrt(v) * sqrt(f / c2) + eps``.

    ``factors`` rescale a frozen variance (``follow_gradient_scale``, :mod:`._grad_scale`): one
    vector (every tensor scaled), or a list of 0-dim tensors where an entry of ``None`` leaves its
    tensor unscaled. ``roots``: ``sqrt(v)`` of each tensor, already taken
    (:func:`root_denominators`); they become the result, scaled in place.
    """
    exp_avg_sqs = list(exp_avg_sqs)

    def sqrt_of(indices: Sequence[int]) -> list[Tensor]:
        if roots is not None:
            return [roots[i] for i in indices]
        return square_roots([exp_avg_sqs[i] for i in indices])

    if factors is not None and not isinstance(factors, Tensor):
        scaled = [i for i, f in enumerate(factors) if f is not None]
        factors = torch.stack([factors[i] for i in scaled]) if scaled else None
    else:
        scaled = range(len(exp_avg_sqs))
    if factors is None:
        out = sqrt_of(range(len(exp_avg_sqs)))
        div_scalar_(out, math.sqrt(c2))
        add_scalar_(out, eps)
    else:
        out: list[Tensor] = [None] * len(exp_avg_sqs)  # type: ignore[list-item]
        plain = sorted(set(range(len(exp_avg_sqs))) - set(scaled))
        if plain:
            plain_roots = sqrt_of(plain)
            div_scalar_(plain_roots, math.sqrt(c2))
            add_scalar_(plain_roots, eps)
            for i, d in zip(plain, plain_roots):
                out[i] = d
        # the scaled ones: sqrt(v) times sqrt(f / c2), one operation where they tile one vector
        dens = per_tensor_in_dtypes("mul", sqrt_of(scaled), factors.div(c2).sqrt_(), in_place=True)
        add_scalar_(dens, eps)
        for i, d in zip(scaled, dens):
            out[i] = d
    return out


def square_roots(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``sqrt(t)`` of each tensor (new tensors): one operation where they tile one vector (:func:`tiling`)."""
    span, reverse = tiling(list(tensors)) if tensors else (None, False)
    return pieces(span.sqrt(), list(tensors), reverse) if span is not None else list(torch._foreach_sqrt(list(tensors)))


def split_denominators(
    exp_avg_sqs: Sequence[Tensor], c2: float, eps: float, factors: Tensor | Sequence[Tensor | None]
) -> tuple[list[Tensor], list[Tensor]]:
    """The plain denominators ``sqrt(v / c2) + eps`` and the scaled ``sqrt(v) sqrt(f / c2) + eps``, one ``sqrt(v)``.

    ``factors``: the scale of ``follow_gradient_scale``, as :func:`denominators` takes it. The same
    bits as :func:`root_denominators` and :func:`denominators` with ``roots=``; where ``v`` tiles one
    vector (flat state, in order or reversed) and every tensor has a factor, computed on that vector and
    cut into pieces once.
    """
    exp_avg_sqs = list(exp_avg_sqs)
    span, reverse = tiling(exp_avg_sqs) if isinstance(factors, Tensor) else (None, False)
    if span is None:
        roots = square_roots(exp_avg_sqs)
        return root_denominators(roots, c2, eps), denominators(exp_avg_sqs, c2, eps, factors, roots=roots)
    roots = span.sqrt()
    plain = roots.div(scalar_operand([roots], math.sqrt(c2))).add_(scalar_operand([roots], eps))
    multipliers = moved(factors.div(c2).sqrt_(), dtype=roots.dtype)
    laid = exp_avg_sqs[::-1] if reverse else exp_avg_sqs
    apply_to_pieces("mul", roots, [t.numel() for t in laid], multipliers.flip(0) if reverse else multipliers)
    scaled = roots.add_(scalar_operand([roots], eps))
    return pieces(plain, exp_avg_sqs, reverse), pieces(scaled, exp_avg_sqs, reverse)


def root_denominators(roots: Sequence[Tensor], c2: float, eps: float) -> list[Tensor]:
    """``sqrt(v / c2) + eps`` from ``roots = sqrt(v)`` (new tensors): :func:`denominators`' bits, ``roots`` kept.

    A frozen variance's plain denominators and its scaled ones (``follow_gradient_scale``) both
    start from ``sqrt(v)``: taken once, it serves both (``roots=`` of :func:`denominators`).
    """
    out = div_scalar(roots, math.sqrt(c2))
    add_scalar_(out, eps)
    return out


def as_dtype(tensors: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """``tensors`` in ``dtype``, each converted only where it is not already (no call per tensor otherwise)."""
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


def as_dtypes(tensors: Sequence[Tensor], like: Sequence[Tensor]) -> list[Tensor]:
    """Each tensor in the dtype of its partner in ``like``, converted only where it differs."""
    return [t if t.dtype == other.dtype else t.to(other.dtype) for t, other in zip(tensors, like)]


def adam_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    c1: float,
    decay: float,
    update_variance: bool,
    make_denominators,  # noqa: ANN001 - () -> list[Tensor], called after the variance update
    divisors: tuple[Sequence[int], Tensor] | None = None,
) -> list[Tensor]:
    """One Adam update of every parameter (see the module docstring); returns the denominators used.

    ``divisors``: positions in the lists and a float32 vector, by which those gradients are
    divided first (:meth:`~._messages.Messages.undo_norm_proxies`, :func:`divided`).
    """
    params, grads, exp_avgs = list(params), list(grads), list(exp_avgs)
    if divisors is not None and update_variance:  # v reads the divided gradients: divide them first
        grads, divisors = divided(grads, *divisors), None
    if update_variance:
        mul_scalar_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(list(exp_avg_sqs), grads, grads, value=1.0 - beta2)
    dens = make_denominators()  # from v alone: the momentum and parameters below do not enter them
    if divisors is not None:
        grads = divided(grads, *divisors)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    if decay != 1.0:
        mul_scalar_(params, decay)
    torch._foreach_addcdiv_(params, exp_avgs, dens, value=-lr / c1)
    return dens


def divided(values: Sequence[Tensor], positions: Sequence[int], divisors: Tensor | None) -> list[Tensor]:
    """The values at ``positions`` over their divisors (a float32 vector, each rounded to its value's dtype),
    as new tensors; the others as they are."""
    out = list(values)
    if divisors is not None and positions:
        for i, value in zip(positions, per_tensor_in_dtypes("div", [values[i] for i in positions], divisors, False)):
            out[i] = value
    return out


def to_update_units(value: Tensor, dens: Tensor, means: Tensor) -> None:
    r"""Divide a message by its per-element weights ``w = d / mean(d)`` in place: the units of the update.

    ``dens`` are the plain denominators ``d = sqrt(v / c2) + eps`` (float32), ``means`` the mean of
    each element's tensor's (:func:`._grad_scale.sample_statistics`), either per element or one
    number for all. A 1-bit gradient or momentum message is
    put in these units before compression and the combined result taken back by
    :func:`from_update_units`. The update of element ``j`` is ``lr * m_j / d_j``, so in these
    units one sign and one segment scale ``s`` cost every element the same, ``lr * s / mean(d)``
    learning rates: the compression error of an element whose variance is orders of magnitude
    below its tensor's (an attention key bias, whose exact gradient is zero, has ``d_j`` near
    ``eps``) is no longer a step of thousands of learning rates, and the large elements of a tensor
    that mixes parts of very different scale (a fused q/k/v bias) no longer set its small parts'
    noise. ``v`` is the same on every rank, so every rank uses the same weights, and while ``v`` is
    frozen error feedback stays exact. Messages must be bounded in these units for the segment
    scale to stay a few learning rates: :func:`clip_to_variance` sees to it. Computed as
    ``value * mean / d``, two in-place passes and no weight tensor.
    """
    value.mul_(means).div_(dens)


def from_update_units(value: Tensor, dens: Tensor, means: Tensor) -> None:
    """The inverse of :func:`to_update_units`, in place: the value times ``d / mean(d)``."""
    value.mul_(dens).div_(means)


def onebit_message(
    out: Tensor,
    grads: Tensor,
    beta2: float,
    clip_dens: Tensor | None,
    exp_avgs: Tensor | None = None,
    beta1: float = 0.0,
    units: tuple[Tensor, Tensor] | None = None,
    l2: tuple[Tensor, float] | None = None,
) -> None:
    """A 1-bit gradient or momentum message into ``out``, from tensors laid out alike (a bucket's, flat).

    The gradient clipped to the variance (:func:`clip_to_variance`, with ``clip_dens``; not when
    ``None``), given its L2 term (``l2``: the parameters and the weight decay, :func:`l2_gradients`),
    turned into the momentum message ``beta1 * m + (1 - beta1) * g`` when ``exp_avgs`` is given
    (``m``; it may be ``out`` itself) as the update computes it (a lerp), then put in units of the
    update when ``units`` (the plain denominators and their means, :func:`to_update_units`).
    """
    g = grads
    if clip_dens is not None:
        (g,) = clip_to_variance([g], [clip_dens], beta2)
    if l2 is not None:
        (g,) = l2_gradients([g], [l2[0]], l2[1])
    if exp_avgs is None:
        out.copy_(g)
    else:
        if exp_avgs is not out:
            out.copy_(exp_avgs)
        out.lerp_(g, 1.0 - beta1)
    if units is not None:
        to_update_units(out, *units)


def variance_bound(beta2: float) -> float:
    """The largest ``|g| / sqrt(v_hat)`` Adam can see, ``1 / sqrt(1 - beta2)`` (``v`` holds ``(1 - beta2) g^2``)."""
    return 1.0 / math.sqrt(1.0 - beta2)


def clip_to_variance(grads: Sequence[Tensor], dens: Sequence[Tensor], beta2: float) -> list[Tensor]:
    r"""Each gradient element clipped to ``|g_j| <= d_j / sqrt(1 - beta2)`` (new tensors), for a frozen ``v``.

    Adam updates ``v`` with every gradient, so ``v_hat >= (1 - beta2) g^2`` and the normalised
    gradient it sees is never above :func:`variance_bound` (31.6 for ``beta2 = 0.999``). A frozen
    ``v`` loses that bound: a token that first appears after the freeze, or an element whose
    gradient grows tenfold, has ``|g| / d`` of thousands, and its step is that many learning
    rates, with or without compression, enough to make a run diverge. Clipped, every element
    stays inside the envelope Adam's own steps have, and every 1-bit message in update units stays
    bounded.
    """
    grads = list(grads)
    bounds = mul_scalar(as_dtypes(dens, grads), variance_bound(beta2))
    out = list(torch._foreach_minimum(grads, bounds))
    torch._foreach_neg_(bounds)
    torch._foreach_maximum_(out, bounds)
    return out


def implied_gradients(exp_avgs: Tensor, combined: Tensor, beta1: float | Tensor) -> None:
    """Turn the combined momentum ``m'`` into the gradient it implies, in place (tensors laid out alike).

    ``g = (m' - beta1 * m) / (1 - beta1)``, so that ``beta1 * m + (1 - beta1) * g == m'``; computed in
    one pass as ``m + (m' - m) / (1 - beta1)`` (a lerp from ``m`` past ``m'``) into a new tensor,
    copied back. ``beta1``: one number, or one per element.
    """
    combined.copy_(torch.lerp(exp_avgs, combined, 1.0 / (1.0 - beta1)))


def local_sq_norms(grads: Sequence[Tensor | None], norms: Tensor | None = None) -> Tensor:
    """``||g||^2`` of each local gradient (0 for ``None``), as one float32 vector (:func:`float32_norms`).

    ``norms``: the norms of every gradient (none ``None``), where already known.
    """
    if norms is not None:
        return norms.square()
    device = next((g.device for g in grads if g is not None), torch.device("cpu"))
    present = [g for g in grads if g is not None]
    if not present:
        return torch.zeros(len(grads), dtype=torch.float32, device=device)
    squares = float32_norms(present).square_()
    if len(present) == len(grads):
        return squares
    zero, each = torch.zeros((), dtype=torch.float32, device=device), iter(squares.unbind())
    return torch.stack([zero if g is None else next(each) for g in grads])


def norm_proxy_factors(
    views: Sequence[Tensor], mean_sq_norms: Tensor, norms: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Rescale each implied gradient in place to the norm ``sqrt(mean_sq_norms[i])``.

    Returns two float32 vectors: the factor applied to each tensor and the norm handed on (the
    view's own norm where the factor is 1: a zero, non-finite or missing norm, or one so small that
    the factor overflows, leaves the view as it is). The views are scaled by
    :func:`~hf_zeroone._tensors.apply_per_tensor`. ``norms``: the views' :func:`float32_norms`,
    where already known.
    """
    views = list(views)
    if not views:
        empty = torch.zeros(0, dtype=torch.float32)
        return empty, empty
    norms = float32_norms(views) if norms is None else norms
    mean_sq = moved(mean_sq_norms, norms.device, torch.float32)
    root = mean_sq.sqrt()
    ratio = root / norms  # inf for a subnormal norm: such a view is left as it is too
    ok = (norms > 0) & (mean_sq > 0) & torch.isfinite(norms) & torch.isfinite(ratio)
    factors = torch.where(ok, ratio, 1.0)
    handed = torch.where(ok, root, norms)
    apply_per_tensor("mul", views, factors, in_place=True)
    return factors, handed
