"""A bucket's 1-bit gradient or momentum message, computed on flat tensors: a few operations per bucket.

:meth:`._messages.Messages.write` hands the ``ONEBIT_GRADIENT`` and ``ONEBIT_MOMENTUM`` kinds to
:func:`onebit_messages`. Every input is first laid flat, in float32, in the message's own layout
(the one :class:`._flat.FlatBuffers` gives a bucket): the gradients (a DDP bucket's buffer
already is), the variance, the momentum and, for L2 weight decay, the parameters. The message
chain of :func:`._functional.onebit_message` then runs once on the flat tensors, whatever the
number of parameters. Per-tensor numbers (the mean denominators, the factors of
``follow_gradient_scale``) enter as flat operands (:func:`hf_zeroone._runs.expanded`).

Parameter groups that agree on the numbers the chain reads (``betas``, ``eps``, the variance's
bias correction and, with L2 decay, the weight decay) share one pass: the decay and no-decay
groups of a transformer as a rule. Groups that differ each get a pass over the bucket, and
every element keeps its own group's result.

The plain denominators and the mean denominators per element (:class:`BucketUnits`) are what
:meth:`._messages.Messages.finish` takes the combined result back with; their per-parameter
views are offered to the optimizer's :class:`._variance_views.VarianceViews`, so the scale
samples of the same bucket read them instead of computing them again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hf_zeroone._runs import expanded
from hf_zeroone._tensors import in_order, moved
from hf_zeroone.optim import _functional as F
from hf_zeroone.optim import _masks
from hf_zeroone.optim._step_kind import StepKind

__all__ = ["BucketUnits", "onebit_messages"]


@dataclass
class BucketUnits:
    """What a bucket's 1-bit message was divided by, flat in the message's layout (float32).

    ``message``: the message (its real elements); ``plain``: the plain denominators
    ``sqrt(v / c2) + eps``, and ``plain_views`` their per-parameter views; ``means``: each
    element's tensor's mean of ``plain``; ``beta1``: each element's group's (one number when the
    groups agree).
    """

    message: Tensor
    plain: Tensor
    plain_views: list[Tensor]
    means: Tensor
    beta1: float | Tensor


def _per_element(values: Sequence[float], bounds: Sequence[int], like: Tensor) -> Tensor:
    """One number per tensor, repeated over its elements (flat, float32, on ``like``'s device)."""
    return expanded(torch.tensor(values, dtype=torch.float32).to(like.device), bounds)


def _merged(parts: Sequence[Tensor], key_of: Tensor | None) -> Tensor:
    """Each element from the part of its key (``key_of``: the key's position per element)."""
    out = parts[0]
    for k, part in enumerate(parts[1:], 1):
        out = torch.where(key_of == k, part, out)
    return out


def onebit_messages(
    opt: Any,  # noqa: ANN401 - a CompressedAdamBase
    kind: StepKind,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    outs: Sequence[Tensor],
    message: Tensor,
    views: Callable[[Tensor], list[Tensor]],
    flat_grads: Tensor | None = None,
) -> BucketUnits:
    """Write each parameter's 1-bit ``kind`` message into ``message`` (``outs``: its per-parameter views).

    ``views`` cuts a flat tensor of the message's layout into per-parameter views (as ``outs``
    are). ``flat_grads``: the gradients already flat in that layout (a DDP bucket's buffer), else
    they are read from ``grads``.
    """
    state, momentum = opt.state, kind is StepKind.ONEBIT_MOMENTUM
    params = list(params)
    for p, g in zip(params, grads):
        _masks.note_activity(state[p], g)
    bounds = [0]
    for p in params:
        bounds.append(bounds[-1] + p.numel())
    keys: dict[tuple, list[tuple[dict, list[Tensor], list[int]]]] = {}
    for group, ps, index in opt.grouped(params, range(len(params))):
        c2 = opt._coefficients(group, kind)[1]
        l2 = group["weight_decay"] if momentum and not group["decoupled_weight_decay"] else 0.0
        keys.setdefault((*group["betas"], group["eps"], c2, l2), []).append((group, ps, index))
    # the inputs, flat in float32: the message's memory is where each is laid out
    outs = list(outs)
    if flat_grads is None:
        torch._foreach_copy_(outs, list(grads))
        g = message.clone()
    else:
        g = flat_grads.to(torch.float32, copy=True)
    torch._foreach_copy_(outs, [state[p]["exp_avg_sq"] for p in params])
    roots = message.sqrt()
    weights = None
    if any(key[4] for key in keys):
        torch._foreach_copy_(outs, params)
        weights = message.clone()
    if momentum:
        torch._foreach_copy_(outs, [state[p]["exp_avg"] for p in params])
        exp_avgs = message.clone() if len(keys) > 1 else message
    key_of = None
    if len(keys) > 1:
        positions = [0.0] * len(params)
        for k, entries in enumerate(keys.values()):
            for _, _, index in entries:
                for i in index:
                    positions[i] = float(k)
        key_of = _per_element(positions, bounds, message)
    plains, means, results, dens = [], [], [], []
    for (beta1, beta2, eps, c2, l2), entries in keys.items():
        (plain,) = F.root_denominators([roots], c2, eps)
        plains.append(plain)
        mean_parts, clip, dens = [], None, views(plain)
        for group, ps, index in entries:
            mine = [dens[i] for i in index]
            vs = [state[p]["exp_avg_sq"] for p in ps]
            opt.variance_views.offer(ps, vs, c2, eps, mine)
            mean_parts.append((index, opt.plain_denominators(group, ps, c2)[1].means))
        means.append(_per_element_vector(mean_parts, len(params), bounds))
        if opt.clip_to_variance:
            clip = _scaled(opt, kind, entries, roots, plain, c2, eps, bounds)
        out = message if len(keys) == 1 else torch.empty_like(message)
        F.onebit_message(
            out, g, beta2, clip, exp_avgs if momentum else None, beta1, (plain, means[-1]),
            (weights, l2) if l2 else None,
        )  # fmt: skip
        results.append(out)
    if len(keys) == 1:
        return BucketUnits(message, plains[0], dens, means[0], next(iter(keys))[0])
    message.copy_(_merged(results, key_of))
    plain = _merged(plains, key_of)
    beta1 = _merged([torch.full_like(message, key[0]) for key in keys], key_of)
    return BucketUnits(message, plain, views(plain), _merged(means, key_of), beta1)


def _per_element_vector(parts: list[tuple[list[int], Tensor]], n: int, bounds: Sequence[int]) -> Tensor:
    """Per-tensor vectors of some groups (``(positions, values)``) as one value per element (0 elsewhere)."""
    covered = sum(len(index) for index, _ in parts)
    device = parts[0][1].device
    if covered < n:  # another key's tensors: any value (their elements take the other key's)
        rest = sorted(set(range(n)) - {i for index, _ in parts for i in index})
        parts = [*parts, (rest, torch.zeros(len(rest), dtype=torch.float32, device=device))]
    vector = in_order([(index, moved(v, device, torch.float32)) for index, v in parts], n)
    return expanded(vector, bounds)


def _scaled(
    opt: Any,  # noqa: ANN401
    kind: StepKind,
    entries: list[tuple[dict, list[Tensor], list[int]]],
    roots: Tensor,
    plain: Tensor,
    c2: float,
    eps: float,
    bounds: Sequence[int],
) -> Tensor:
    """The denominators clipping uses: ``sqrt(v) * sqrt(f / c2) + eps`` where ``follow_gradient_scale``
    has a factor ``f`` for the tensor, the plain ones elsewhere (:func:`._functional.denominators`)."""
    n = len(bounds) - 1
    parts, has = [], []
    for group, ps, index in entries:
        factors = opt.scale_factors(group, ps) if kind.frozen_variance else None
        if factors is None:
            continue
        if not isinstance(factors, Tensor):
            index = [i for i, f in zip(index, factors) if f is not None]
            if not index:
                continue
            factors = torch.stack([f for f in factors if f is not None])
        parts.append((index, moved(factors, dtype=torch.float32).div(c2).sqrt_()))
        has += index
    if not has:
        return plain
    scaled = roots * _per_element_vector(parts, n, bounds)
    scaled.add_(eps)
    if len(has) == n:
        return scaled
    flags = [0.0] * n
    for i in has:
        flags[i] = 1.0
    return torch.where(_per_element(flags, bounds, roots) > 0, scaled, plain)
