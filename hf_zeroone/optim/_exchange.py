"""Communication in ``step()``: every parameter's message combined across ranks when no DDP hook ran.

The DDP hook (:mod:`hf_zeroone.ddp_hook`) and this module are the two callers of the optimizer's
message protocol (:class:`._messages.Messages`): the hook with DDP's buckets during
backward, this module with buckets of its own in ``step()`` (no DDP, DDP without the hook, and
every 0/1 Adam sync).
"""

from __future__ import annotations

import functools
from itertools import groupby
from typing import Any

import torch
from torch import Tensor

from hf_zeroone._tensors import moved
from hf_zeroone.optim import _functional as F
from hf_zeroone.optim import _local_phase, _masks
from hf_zeroone.optim._flat import consecutive_views, split_in_buckets
from hf_zeroone.optim._functional import by_group
from hf_zeroone.optim._step_kind import StepKind

__all__ = ["exchange"]

Update = tuple[dict[str, Any], Tensor, Tensor]


def exchange(opt: Any, kind: StepKind) -> list[Update]:  # noqa: ANN401 - a CompressedAdamBase
    """Compute every trainable parameter's message and combine it across ranks; ``(group, param, result)``.

    A single process sends nothing: the "combined" value is the message itself.
    """
    pairs = opt.trainable_params()
    if not pairs:
        return []
    if not opt.comm.is_distributed:
        return _single_process(opt, kind, pairs)
    results: list[Update] = []
    buckets = split_in_buckets(pairs, opt.step_bucket_numel)
    if not kind.compressed:  # an exact message has one dtype, as each of DDP's buckets has
        buckets = [list(run) for bucket in buckets for _, run in groupby(bucket, key=lambda item: item[1].dtype)]
    for bucket in buckets:  # one bucket's message at a time
        params = [p for _, p in bucket]
        grads = [p.grad for p in params]
        if kind.compressed:
            flat = opt.flat_cache.get(params)
            message, views = flat.new_message(), flat.views
            message[flat.layout.numel :].zero_()
        else:
            # as the hook sends DDP's bucket, whose dtype is its parameters'
            dtype = opt.exact_message_dtype(params[0].dtype)
            message = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
            views = functools.partial(consecutive_views, params)
        message_views = views(message)
        units = opt.messages.write(
            kind, params, grads, message_views, message[: flat.layout.numel] if kind.compressed else None, views
        )
        lane = opt.messages.lane(kind, params, grads)
        if kind.compressed:  # the result comes back in the message's memory, and so in its views
            opt.comm.compressed_allreduce(message, flat.worker_error, flat.server_error, flat.layout, lane)
            combined_views = message_views
        else:
            combined_views = views(opt.average_exact_async(message, params, lane).wait())
        del message, message_views  # a compressed result lives in its memory (freed with the views)
        opt.messages.finish(kind, params, combined_views, lane, units=units)
        units = None  # its denominators: no full-size copy outlives the bucket
        if kind is StepKind.ONEBIT_MOMENTUM:
            # as the hook's result would be after an unclipped step: handed back in the parameter's
            # dtype (DDP's bucket), then the norm proxy undone; both paths then agree bit for bit.
            # Kept in the combined buffer where the dtypes agree (fp32 parameters).
            handed = [moved(v, dtype=p.dtype) for p, v in zip(params, combined_views)]
            undone = opt.messages.undo_norm_proxies(params, handed)
            combined_views = [v.copy_(u) if u.dtype == v.dtype else u for v, u in zip(combined_views, undone)]
        results += [(group, p, view) for (group, p), view in zip(bucket, combined_views)]
    return results


def _single_process(opt: Any, kind: StepKind, pairs: list[tuple[dict[str, Any], Tensor]]) -> list[Update]:  # noqa: ANN401
    """What one process "combines": its own messages, as the maths of every kind without compression.

    A 1-bit momentum message ``beta1 m + (1 - beta1) g`` implies the gradient ``g`` back, so the
    gradient (clipped to the variance, with its L2 term) is handed on as it is; a sync's
    displacement leaves the parameters where the local steps put them.
    """
    results: list[Update] = []
    for group, params, grads in by_group([(g, p, p.grad) for g, p in pairs if p.grad is not None]):
        states = [opt.state[p] for p in params]
        if kind is StepKind.ONEBIT_SYNC:  # the message without its units: the displacements themselves
            values = _local_phase.new_displacements(params, states)
            _local_phase.idle_messages(opt, params, states, values)
        elif kind.compressed:  # ONEBIT_GRADIENT, ONEBIT_MOMENTUM
            for state, g in zip(states, grads):
                _masks.note_activity(state, g)
            values = list(grads)
            if opt.clip_to_variance:
                c2 = opt._coefficients(group, kind)[1]
                values = F.clip_to_variance(values, opt._denominators(group, params, kind, c2), group["betas"][1])
            if kind is StepKind.ONEBIT_MOMENTUM and group["weight_decay"] and not group["decoupled_weight_decay"]:
                values = F.l2_gradients(values, params, group["weight_decay"])
            values = [v * st["momentum_mask"] if "momentum_mask" in st else v for v, st in zip(values, states)]
        else:
            values = list(grads)
        results += [(group, p, v) for p, v in zip(params, values)]
    if opt.follow_gradient_scale and kind in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM) and results:
        used = [p for _, p, _ in results]
        opt.gradient_scale.record(used, opt.messages.scale_samples(used, [p.grad for p in used]))
    return results
