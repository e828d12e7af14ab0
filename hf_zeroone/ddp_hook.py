"""DDP communication hook: 1-bit and local-step communication instead of DDP's fp32 allreduce.

``DistributedDataParallel`` calls a communication hook for each gradient bucket as soon as the
bucket's gradients are ready, while backward goes on for earlier layers. This hook asks the
optimizer what the coming step needs (:meth:`~hf_zeroone.optim.CompressedAdamBase.prepare_step`)
and, bucket by bucket:

* ``EXACT``: averages the bucket in full precision (what DDP would have done), or in the
  optimizer's ``exact_step_dtype``;
* ``ONEBIT_GRADIENT`` / ``ONEBIT_MOMENTUM``: writes each parameter's message
  (:meth:`~hf_zeroone.optim.CompressedAdamBase.messages`: the gradient or the local
  momentum) into a flat buffer and starts the error-compensated 1-bit allreduce on it;
* ``LOCAL`` / ``ONEBIT_SYNC``: sends nothing and hands the local gradient back. A sync step
  needs this step's gradient *after* clipping, so the optimizer sends ``u`` in ``step()``.

DDP writes the combined values into ``p.grad``; the optimizer's ``step()`` sees that the hook has
communicated for this step and applies them without communicating again. Compressed
communication thus overlaps with backward, where DeepSpeed does it all after backward.

What ``p.grad`` holds after backward, by step kind, which is what gradient clipping acts on (the
Trainer clips between backward and ``step()``):

* ``EXACT``: the averaged gradient, as with plain DDP;
* ``ONEBIT_GRADIENT``: the 1-bit averaged gradient, identical on every rank;
* ``ONEBIT_MOMENTUM``: the averaged gradient implied by the combined momentum
  (:meth:`hf_zeroone.optim._messages.Messages.finish`), identical on every rank,
  rescaled per tensor to an estimate of the averaged gradient's norm, the norm AdamW's clipping
  would see (:meth:`hf_zeroone.optim._messages.Messages.finish`: the local squared norms averaged
  over ranks, one extra float per tensor per bucket, over the local gradients' noise excess);
  ``step()`` divides the factor out, so clipping scales only this step's gradient contribution
  to the momentum;
* ``LOCAL`` and ``ONEBIT_SYNC``: the local gradient, divided per tensor by the square root of
  its noise excess (:meth:`hf_zeroone.optim._messages.Messages.hand_on_local_gradients`), so that
  clipping sees about the averaged gradient's norm, as AdamW's would, and not the larger local
  one; ``step()`` scales it back. The update is local until the sync, which averages what the
  clipped local steps accumulated.

With fp16 gradients a GradScaler skips the step when it finds inf/NaN, and every rank must skip
together. Steps that communicate in backward already agree (a non-finite value on one rank reaches
all ranks). On ``LOCAL`` and ``ONEBIT_SYNC`` steps the hook adds one 4-byte allreduce per bucket so that an
overflow on one rank is seen by all (``ZeroOneHookState.overflow_check_on_local_steps``: automatic
when a GradScaler is registered or the buckets are fp16; off otherwise, and local steps send nothing).

**Gradient accumulation.** Under ``ddp_model.no_sync()`` DDP calls no hook, and the gradients of
the micro-steps add up locally until the last backward pass combines them once, as the optimizer
needs (one message per step: the momentum, the error feedback). A loop that accumulates *without*
``no_sync()`` makes DDP call the hook on every backward pass; a second call for one bucket in one
step (no ``step()``, ``optimizer.zero_grad()`` or GradScaler ``update()`` between) shows it. The hook warns
once, leaves that step to ``step()``, counts its passes
(``ZeroOneHookState.backward_passes_per_step``) and from then on hands the earlier passes'
gradients back as they are and combines on the last, which is what ``no_sync()`` does. A step
with fewer passes (the end of an epoch) is left to ``step()`` too; three in a row set the count
anew. Handed-back buckets agree on overflow across ranks when there is a GradScaler, since the
scaler may then read them before ``step()`` (:mod:`hf_zeroone._iterations`).

DDP builds its buckets anew after the first iteration; the optimizer's flat buffers follow any
bucket layout (each parameter keeps its own error state), so compression may start at any step.

Usage::

    ddp_model = DistributedDataParallel(model)
    optimizer = ZeroOneAdam(ddp_model.parameters(), lr=1e-4, var_freeze_step=1000)
    register_zeroone_hook(ddp_model, optimizer)
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at runtime.
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from hf_zeroone._iterations import BackwardPasses, forget_results_on_next_backward
from hf_zeroone._iterations import known as known_passes
from hf_zeroone.optim import CompressedAdamBase, StepKind
from hf_zeroone.optim._flat import consecutive_views
from hf_zeroone.optim.onebit_diloco import OneBitDiLoCo

__all__ = ["ZeroOneHookState", "local_gradients_hook", "register_zeroone_hook", "zeroone_hook"]


@dataclass
class ZeroOneHookState:
    """State of :func:`zeroone_hook`: the optimizer whose schedule drives communication.

    Attributes:
        optimizer: a :class:`~hf_zeroone.optim.CompressedAdamBase` (``OneBitAdam``,
            ``ZeroOneAdam``); its communicator carries all traffic and counts it.
        overflow_check_on_local_steps: on ``LOCAL`` and ``ONEBIT_SYNC`` steps, agree across ranks
            on whether any gradient is non-finite (one 4-byte allreduce per bucket) so a GradScaler
            skips the step on every rank. ``None`` (default): when ``grad_scaler`` is an enabled
            GradScaler, or the buckets are fp16; ``False``: never (local steps send nothing).
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss, if any. The hook runs
            before the scaler unscales the gradients, so compressed messages are built from
            ``g / S`` (the momentum and both error buffers stay in unscaled units, whatever the
            scale does) and the results are handed back times ``S`` for the scaler to unscale.
            Without it, messages mix the scaled gradient with the unscaled momentum.
        buckets_seen: number of bucket calls (for tests and diagnostics).
        backward_passes_seen: number of backward passes that called the hook (its calls for bucket 0),
            the same on every rank: every ``check_replicas_every``-th checks the replicas (see
            :class:`~hf_zeroone.optim.CompressedAdamBase`).
        backward_passes_per_step: (read-only) ``None`` until DDP calls the hook again within one
            step (gradient accumulation without ``no_sync()``); then the number of backward passes
            per step, the last of which combines the gradients (see the module). Kept in the
            optimizer's schedule, so a checkpoint of the optimizer carries it to a resumed run.
    """

    optimizer: CompressedAdamBase
    overflow_check_on_local_steps: bool | None = None
    grad_scaler: "torch.amp.GradScaler | None" = None
    buckets_seen: int = field(default=0)
    backward_passes_seen: int = field(default=0)
    _passes: BackwardPasses = field(default_factory=BackwardPasses, init=False, repr=False)
    #: per bucket index: its buffer's address, its parameters and their views of it (see gradient_views)
    _views: dict = field(default_factory=dict, init=False, repr=False)

    def gradient_views(self, bucket: dist.GradBucket, params: list) -> list[Tensor]:
        """Each parameter's gradient as a view of the bucket's buffer, in the order DDP lays it there.

        DDP keeps a bucket's buffer from one iteration to the next, so the views are made once per
        bucket, not on every call; when DDP rebuilds its buckets, every bucket's are made again (and
        the old buffers' released).
        """
        buffer = bucket.buffer()
        cached = self._views.get(bucket.index())
        if cached is not None and cached[0] == buffer.data_ptr() and cached[1] == tuple(map(id, params)):
            return cached[2]
        if cached is not None:  # a rebuild: no view of an old buffer stays
            self._views.clear()
        views = consecutive_views(params, buffer)
        self._views[bucket.index()] = (buffer.data_ptr(), tuple(map(id, params)), views)
        return views

    @property
    def backward_passes_per_step(self) -> "int | None":
        """``None`` until DDP calls the hook again within one step (see the module); then the passes per step."""
        return known_passes(self.optimizer)

    def loss_scale(self) -> Tensor | None:
        """The scaler's current scale as a one-element tensor, or ``None`` without an enabled scaler."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        scale = getattr(scaler, "_scale", None)  # a tensor: no host sync, unlike get_scale()
        return scale.double() if isinstance(scale, Tensor) else torch.tensor(float(scaler.get_scale()))


def non_finite_flag(t: Tensor) -> Tensor:
    """``[1.0]`` if ``t`` has a NaN or infinite element, else ``[0.0]``: float32, on ``t``'s device.

    Never read on the host (no GPU sync): ``aminmax`` propagates NaN, and an infinity is the
    minimum or the maximum. One pass that writes nothing per element.
    """
    if t.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=t.device)
    low, high = torch.aminmax(t.detach().reshape(-1))
    return (~(torch.isfinite(low) & torch.isfinite(high))).to(torch.float32).reshape(1)


def _done(value: Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def zeroone_hook(state: ZeroOneHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Communicate one DDP gradient bucket as the optimizer's schedule requires this step."""
    opt = state.optimizer
    state.buckets_seen += 1
    opt.check_ranks_agree()  # before any collective of this step, a handed-back bucket's included
    if bucket.index() == 0:  # DDP calls the buckets in order: a backward pass's first call
        state.backward_passes_seen += 1
        every = opt.check_replicas_every
        if every and state.backward_passes_seen % every == 0:
            # here, not in step(): a rank that skipped a step() still runs every backward pass, so the
            # check's collective meets the same one on every rank and the drift is named, not left to
            # pair with another collective
            opt.check_replicas(f"at backward pass {state.backward_passes_seen} (DDP hook)")
    if state._passes.hands_back(opt, state.grad_scaler, bucket.index()):
        # as under no_sync(): the gradients add up locally, and nothing in p.grad is combined. The
        # step may end here (left to step(), after a GradScaler looked at the local gradients), so
        # ranks agree on overflow whenever there is a scaler (_agreed_local)
        opt.communicated_step = None
        return _agreed_local(state, bucket.buffer())
    kind = opt.prepare_step()
    opt.communicated_step = opt.schedule["step"]
    buffer = bucket.buffer()
    if not kind.communicates_in_backward:
        # each local gradient over its noise excess: clipping sees an averaged-gradient-sized norm
        params = bucket.parameters()
        opt.messages.hand_on_local_gradients(params, state.gradient_views(bucket, params), in_place=True)
        return _agreed_local(state, buffer)
    # not bucket.gradients(): it views a gradient that DDP keeps in its parameter's memory order (a
    # transposed weight, channels_last) row-major, that is transposed
    params = bucket.parameters()
    scale = state.loss_scale()
    if scale is not None and kind.compressed:
        # A GradScaler's overflow can be a plain inf, which clipping to the variance would bound to
        # a finite message: as NaN it reaches every rank's result, and every rank's scaler skips
        buffer.masked_fill_(non_finite_flag(buffer) > 0, float("nan"))
    grads = views = state.gradient_views(bucket, params)
    unscaled = buffer
    if scale is not None:  # messages in unscaled units
        unscaled = buffer.div(scale.to(device=buffer.device, dtype=buffer.dtype))
        grads = consecutive_views(params, unscaled)
    if kind is StepKind.EXACT:
        return _exact(opt, buffer, params, views, opt.messages.lane(kind, params, grads), scale)
    flat = opt.flat_cache.get(params)
    message, n = flat.new_message(), flat.layout.numel
    message[n:].zero_()
    # the compressed allreduce returns its result in the message's memory: these views serve both
    views = flat.views(message)
    units = opt.messages.write(kind, params, grads, views, message[:n], flat.views, unscaled[:n])
    # Exactly averaged beside the 1-bit message, in the same two collectives: on 1-bit momentum
    # steps the local squared norms (gradient-sized norms for clipping) and the gradient's scale
    # (hf_zeroone.optim._grad_scale); on every 1-bit step the flags of masked rows that moved.
    lane = opt.messages.lane(kind, params, grads)
    fut = opt.comm.compressed_allreduce_async(message, flat.worker_error, flat.server_error, flat.layout, lane)
    dtype = buffer.dtype

    # The callback only computes on tensors: no collective is ever issued inside a callback, and
    # no device value is read on the host. On CUDA it runs on a stream that waited for the
    # communicator's, and the future it completes is CUDA-aware like the communicator's.
    def to_gradient(f: torch.futures.Future) -> Tensor:
        nonlocal units
        combined = f.wait()
        opt.messages.finish(kind, params, views, lane, units=units)
        units = None  # its denominators: no full-size copy outlives the bucket
        result = combined[:n]
        if scale is not None:  # scaled again: the GradScaler unscales p.grad before step()
            result = result.mul(scale.to(device=result.device, dtype=result.dtype))
        return result.to(dtype)

    # Not torch.futures.collect_all: the future it returns is not CUDA-aware.
    return fut.then(to_gradient)


def _exact(
    opt: CompressedAdamBase, buffer: Tensor, params: list, views: list, lane: "Tensor | None", scale: "Tensor | None"
):  # noqa: ANN202
    """Average the bucket (an fp32 one in ``exact_step_dtype`` when one is set) and its exact lane, the scale samples.

    ``views``: each parameter's gradient in ``buffer``. The samples of the local gradients and of
    the averaged ones measure the noise excess of local gradients (:mod:`hf_zeroone.optim._grad_scale`);
    they ride in the message's collective
    (:meth:`~hf_zeroone.comm.Communicator.allreduce_mean_async`).
    """
    dtype = opt.exact_message_dtype(buffer.dtype)
    message = buffer.to(dtype) if dtype != buffer.dtype and opt.comm.is_distributed else buffer
    fut = opt.average_exact_async(message, params, lane)
    if message is buffer and lane is None:
        return fut

    def record(f: torch.futures.Future) -> Tensor:
        averaged = f.wait()
        if averaged is not buffer:
            buffer.copy_(averaged)  # what step() applies: the rounded average, in the bucket's dtype
        if lane is not None:
            opt.messages.finish(StepKind.EXACT, params, views, lane, loss_scale=scale)
        return buffer

    return fut.then(record)


def _agreed_local(state: ZeroOneHookState, buffer: Tensor) -> torch.futures.Future:
    """The local bucket, marked non-finite on every rank if it is on one.

    With ``overflow_check_on_local_steps``; by default (``None``) for fp16 buckets and whenever an
    enabled GradScaler was registered: the scaler reads these local gradients and skips ``step()``
    on a rank that finds an overflow, so without agreement one rank would skip alone and the
    ranks' schedules would part.
    """
    check = state.overflow_check_on_local_steps
    scaled = state.grad_scaler is not None and state.grad_scaler.is_enabled()
    if check or (check is None and (scaled or buffer.dtype == torch.float16)):
        return _agree_on_overflow(state.optimizer, buffer)
    return _done(buffer)


def _agree_on_overflow(opt: CompressedAdamBase, buffer: Tensor) -> torch.futures.Future:
    """Make a non-finite gradient on any rank visible on all (local steps, fp16); no host read."""
    fut = opt.comm.allreduce_mean_async(non_finite_flag(buffer))

    def mark(f: torch.futures.Future) -> Tensor:
        return buffer.masked_fill_(f.wait()[0] > 0, float("inf"))

    return fut.then(mark)


def local_gradients_hook(state: None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:class:`~hf_zeroone.optim.OneBitDiLoCo`'s hook: every rank keeps its own gradients, nothing is sent."""
    return _done(bucket.buffer())


def register_zeroone_hook(
    ddp_model: DistributedDataParallel,
    optimizer: "CompressedAdamBase | OneBitDiLoCo",
    grad_scaler: "torch.amp.GradScaler | None" = None,
) -> "ZeroOneHookState | None":
    """Register :func:`zeroone_hook` on ``ddp_model`` for ``optimizer``; returns the hook state.

    For :class:`~hf_zeroone.optim.OneBitDiLoCo` it registers :func:`local_gradients_hook`
    (backward sends nothing; the optimizer syncs the parameters itself) and returns ``None``.

    Pass the ``grad_scaler`` of fp16 mixed precision (see :class:`ZeroOneHookState`).

    Checks, before any training step, that the optimizer manages exactly the model's trainable
    parameters and communicates over a group of the same size as DDP's.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"register_zeroone_hook needs a torch DistributedDataParallel model, got {type(ddp_model).__name__}"
        )
    if not isinstance(optimizer, (CompressedAdamBase, OneBitDiLoCo)):
        raise TypeError(
            f"register_zeroone_hook needs a hf_zeroone optimizer (OneBitAdam, ZeroOneAdam, OneBitDiLoCo), "
            f"got {type(optimizer).__name__}"
        )
    if grad_scaler is not None and not callable(getattr(grad_scaler, "is_enabled", None)):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
    if getattr(ddp_model, "_comm_hooks", None):
        raise RuntimeError(
            "this DDP model has a communication hook already, and DDP takes one: yours, DDP's mixed_precision, "
            "Accelerate's comm_hook, or ours (register_zeroone_hook, prepare_zeroone and ZeroOneTrainer each "
            "register one: call one of them once per model, and no other hook)"
        )
    if isinstance(optimizer, OneBitDiLoCo):
        _check_same_params(ddp_model, optimizer.trainable_params(), optimizer.comm.world_size)
        if grad_scaler is not None:
            raise ValueError("OneBitDiLoCo does not support fp16 with a GradScaler (a step skipped on one rank "
                             "only would put the ranks' syncs on different iterations); train in bf16")  # fmt: skip
        ddp_model.register_comm_hook(None, local_gradients_hook)
        return None
    sparse = [
        name
        for name, m in ddp_model.module.named_modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
    ]
    if sparse:
        raise ValueError(
            f"modules {sparse} produce sparse gradients, which 1-bit compression does not support; "
            "build them with sparse=False"
        )
    _check_same_params(ddp_model, [p for _, p in optimizer.trainable_params()], optimizer.comm.world_size)
    state = ZeroOneHookState(optimizer, grad_scaler=grad_scaler)
    ddp_model.register_comm_hook(state, zeroone_hook)
    optimizer.hook_checks_replicas = True
    # a later backward pass, not a forward, ends this iteration's results (see ._iterations)
    ddp_model.register_forward_hook(
        forget_results_on_next_backward(lambda: setattr(optimizer, "communicated_step", None))
    )
    return state


def _check_same_params(ddp_model: DistributedDataParallel, params: list, world_size: int) -> None:
    """The optimizer manages exactly the model's trainable parameters, over a group of DDP's size."""
    model_params = {id(p) for p in ddp_model.parameters() if p.requires_grad}
    opt_params = {id(p) for p in params}
    if model_params != opt_params:
        raise ValueError(
            f"the optimizer manages {len(opt_params)} trainable parameters and the DDP model has "
            f"{len(model_params)} ({len(model_params - opt_params)} of the model's are missing from the "
            "optimizer); build the optimizer from ddp_model.parameters() (or the same parameter groups)"
        )
    ddp_world = dist.get_world_size(ddp_model.process_group)
    if ddp_world != world_size:
        raise ValueError(
            f"DDP runs on {ddp_world} ranks but the optimizer communicates over {world_size}; "
            "pass the DDP process group to the optimizer (process_group=...)"
        )
