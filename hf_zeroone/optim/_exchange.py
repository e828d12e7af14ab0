"""Communication in ``step()``: every parameter's message combined across ranks when no DDP hook ran.

The DDP hook (:mod:`hf_zeroone.ddp_hook`) and this module are the two callers of the optimizer's
message protocol (:class:`._messages.Messages`): the hook with DDP's buckets during
backward, this module with buckets of its own in ``step()`` (no DDP, DDP without the hook, and
every 0/1 Adam sync).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from hf_zeroone.optim import _functional as F
from hf_zeroone.optim._flat import consecutive_views, split_in_buckets
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
    params = [p for _, p in pairs]
    results: list[Update] = []
    for bucket in split_in_buckets(pairs, opt.step_bucket_numel):  # one bucket's message at a time
        bucket_params = [p for _, p in bucket]
        if kind.compressed:
            flat = opt.flat_cache.get(bucket_params)
            message, views = flat.new_message(), flat.views
            message[flat.layout.numel :].zero_()
        else:
            numel = sum(p.numel() for p in bucket_params)
            message = torch.empty(numel, dtype=torch.float32, device=params[0].device)
            views = functools.partial(consecutive_views, bucket_params)
        opt.messages.write(kind, bucket_params, [p.grad for p in bucket_params], views(message))
        if kind.compressed:
            combined = opt.comm.compressed_allreduce(message, flat.worker_error, flat.server_error, flat.layout)
        else:
            combined = opt.comm.allreduce_mean(message)
        del message  # the compressed allreduce's scratch: freed before the next bucket
        combined_views = views(combined)
        opt.messages.from_update_units(kind, bucket_params, combined_views)
        results += [(group, p, view) for (group, p), view in zip(bucket, combined_views)]
    grads = [p.grad for p in params]
    floats = opt.messages.exact_floats(kind, params, grads)
    if floats is not None:
        floats = opt.comm.allreduce_mean(floats.to(params[0].device))
    if kind is StepKind.EXACT and floats is not None:
        opt.grad_scale.record(params, floats)
    if kind is StepKind.ONEBIT_MOMENTUM:
        views = [v for _, _, v in results]
        opt.messages.read_momentum(params, views, floats)
        # back into the combined buffer, as the hook's result would be after an unclipped step: both
        # paths then agree bit for bit; one parameter's worth of scratch at a time
        results = [(g, p, v.copy_(opt.messages.undo_norm_proxy(p, v))) for g, p, v in results]
    return results


def _single_process(opt: Any, kind: StepKind, pairs: list[tuple[dict[str, Any], Tensor]]) -> list[Update]:  # noqa: ANN401
    results = []
    for group, p in pairs:
        if p.grad is None:
            continue  # like torch.optim: a parameter without gradient is left alone
        out = torch.empty_like(p, dtype=torch.float32)
        opt.messages.write(kind, [p], [p.grad], [out], units=False)
        state = opt.state[p]
        if kind.compressed and "momentum_mask" in state:
            out.mul_(state["momentum_mask"])  # as the compressed allreduce does
        if kind is StepKind.ONEBIT_MOMENTUM:
            F.implied_gradients([state["exp_avg"]], [out], group["betas"][0])
        results.append((group, p, out))
    if opt.follow_gradient_scale and kind in (StepKind.EXACT, StepKind.ONEBIT_MOMENTUM) and results:
        used = [p for _, p, _ in results]
        opt.grad_scale.record(used, opt.messages.scale_samples(used, [p.grad for p in used]))
    return results
