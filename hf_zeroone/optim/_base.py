"""Shared machinery of the communication-compressed Adam optimizers.

An optimizer step has a :class:`StepKind` fixed by the optimizer's schedule before backward runs.
Each kind says what every rank contributes (its *message*), how messages are combined across
ranks, and how the combined *result* updates the state:

================  ==================================  =====================  ==========================
kind              message of rank i                   combined by            result is used as
================  ==================================  =====================  ==========================
EXACT             g_i                                 fp32 allreduce (mean)  gradient: m and v
ONEBIT_GRADIENT   g_i                                 1-bit allreduce        gradient: m only
ONEBIT_MOMENTUM   beta1 * m + (1 - beta1) * g_i       1-bit allreduce        new m, as implied gradient
LOCAL             (nothing sent)                      --                     local gradient: m
ONEBIT_SYNC       u, after this step's local update   1-bit allreduce        accumulated update u
================  ==================================  =====================  ==========================

The first three kinds communicate gradient-like messages that are ready when backward ends, so
the DDP hook sends them during backward. ``ONEBIT_SYNC`` is a local step followed by a sync of
``u``; since ``u`` needs this step's (possibly clipped) gradient, it is sent in ``step()``, after
backward and clipping, by every path. Only sync steps (one in up to ``local_step_clipper`` steps
of 0/1 Adam's local phase) lose the overlap with backward.

What each rank sends and what the combined result becomes is :class:`._messages.Messages` (the
optimizer's ``messages``): 1-bit messages in units of the update, and the implied gradient of a
1-bit momentum step, rescaled so that gradient clipping sees a gradient-sized norm. Two callers
communicate with it: ``step`` itself (:mod:`._exchange`) when nobody communicated during backward
(no DDP, or DDP without our hook), and the DDP communication hook (:mod:`hf_zeroone.ddp_hook`),
which writes the messages into DDP's gradient buckets during backward and hands the results back
as ``p.grad``. :meth:`CompressedAdamBase.step` applies the results; the per-element maths is in
:mod:`._functional`, so each formula exists once.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from hf_zeroone._tensors import all_finite
from hf_zeroone._warnings import user_stacklevel
from hf_zeroone.comm import CommStats, Communicator
from hf_zeroone.optim import _checkpoint, _grad_scale, _local_phase, _masks, _memory
from hf_zeroone.optim import _functional as F
from hf_zeroone.optim._exchange import exchange
from hf_zeroone.optim._flat import FlatBufferCache, FlatBuffers
from hf_zeroone.optim._grad_scale import GradientScale
from hf_zeroone.optim._messages import Messages
from hf_zeroone.optim._step_kind import StepKind, _check_int, check_adam_arguments

__all__ = ["CompressedAdamBase", "FlatBuffers", "StepKind"]


def _by_group(items: Sequence[tuple[dict[str, Any], Tensor, Tensor]]) -> list[tuple[dict[str, Any], list, list]]:
    """``(group, params, values)`` per parameter group, in order of first appearance."""
    out: dict[int, tuple[dict[str, Any], list, list]] = {}
    for group, p, value in items:
        entry = out.setdefault(id(group), (group, [], []))
        entry[1].append(p)
        entry[2].append(value)
    return list(out.values())


class CompressedAdamBase(Optimizer):
    """Adam with a communication schedule; subclasses define the schedule.

    Args:
        params: parameters or parameter groups, as for :class:`torch.optim.AdamW`.
        lr: learning rate.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to ``sqrt(v_hat)`` in the denominator.
        weight_decay: weight-decay coefficient.
        bias_correction: divide ``m`` by ``1 - beta1^t`` and ``v`` by ``1 - beta2^k`` (``k`` counts
            the variance updates actually made). On by default, like ``torch.optim.AdamW``;
            DeepSpeed applies none (pass ``False`` to port a DeepSpeed config exactly).
        decoupled_weight_decay: ``True`` (default) decays parameters directly,
            ``p <- p * (1 - lr * wd)`` (AdamW, what Hugging Face users expect, and what DeepSpeed
            does); ``False`` adds ``wd * p`` to the gradient (L2, ``torch.optim.Adam``).
        process_group: data-parallel group; ``None`` means the default group when
            ``torch.distributed`` is initialised, or a single process (no communication).
        auto_momentum_mask: at the first compressed step, keep out of compression every element
            whose ``exp_avg_sq`` is exactly zero (it never had a gradient, e.g. position
            embeddings beyond the sequence length, or tokens not seen yet). One bit cannot say
            zero, so without a mask such elements collect compression error and drift. A masked
            row that later receives a gradient on any rank leaves the mask (one small allreduce
            per compressed step while rows are masked, see :mod:`hf_zeroone.optim._masks`).
        communicator: an existing :class:`~hf_zeroone.comm.Communicator` to use instead of
            creating one from ``process_group``.
        check_replicas_every: every this many synchronising steps, check that all ranks hold
            bit-identical parameters (one all-gather of 16 bytes) and raise ``RuntimeError`` if
            they do not. ``0`` (default) disables the check.
        follow_gradient_scale: after the variance freeze, rescale the frozen ``v`` of each tensor
            (down only) by how much its gradients have shrunk relative to it (one float per
            tensor, averaged with a collective the step already makes; exact steps add one small
            allreduce; see :mod:`hf_zeroone.optim._grad_scale`). On by default: without it, least
            squares whose loss falls 100x after the freeze ends 3x (1-bit) and 5x (0/1 Adam)
            above AdamW's final loss; ``False`` keeps ``v`` frozen as the papers and DeepSpeed do.

    With no process group, or a world size of 1, the optimizer communicates nothing and runs Adam
    with the same schedule (so it can be used and tested in a single process).
    """

    #: the hyper-parameters that define the schedule (stored in ``state_dict``); set by subclasses
    schedule_params: tuple[str, ...] = ()
    #: when ``step()`` communicates (no DDP hook ran, and every sync of 0/1 Adam), parameters go in
    #: buckets of at most this many elements, one message at a time: 25 MiB of fp32, DDP's default
    #: bucket size. Bounds the transient memory of a step; a larger parameter gets a bucket of its own.
    step_bucket_numel: int = 25 * 2**20 // 4

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        bias_correction: bool,
        decoupled_weight_decay: bool,
        process_group: dist.ProcessGroup | None,
        auto_momentum_mask: bool,
        communicator: Communicator | None,
        check_replicas_every: int = 0,
        follow_gradient_scale: bool = True,
    ) -> None:
        _check_int("check_replicas_every", check_replicas_every, 0)
        check_adam_arguments(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=float(lr),
            betas=(float(betas[0]), float(betas[1])),
            eps=float(eps),
            weight_decay=float(weight_decay),
            bias_correction=bool(bias_correction),
            decoupled_weight_decay=bool(decoupled_weight_decay),
        )
        super().__init__(params, defaults)
        self.auto_momentum_mask = bool(auto_momentum_mask)
        self.follow_gradient_scale = bool(follow_gradient_scale)
        self.comm = communicator if communicator is not None else Communicator(process_group)
        self.schedule: dict[str, Any] = {
            "step": 0,
            "variance_updates": 0,
            "masks_ready": False,
            "grad_sq_updates": 0,  # samples folded into each tensor's gradient mean square (._grad_scale)
        }
        self.schedule.update(self._initial_schedule())
        #: the flat error buffers, one per list of parameters communicated together (see ._flat)
        self.flat_cache = FlatBufferCache(
            lambda p: self.state[p], self.comm.world_size, self.comm.rank, type(self).__name__
        )
        #: this step's samples of follow_gradient_scale (see ._grad_scale)
        self.grad_scale = GradientScale()
        self._prepared_step = -1
        self._group_of: dict[int, dict[str, Any]] | None = None
        #: set by a DDP hook: the step whose results are already in ``p.grad``
        self.communicated_step: int | None = None
        self._stats_at_step_start = CommStats()
        #: bytes and collectives of the last completed step, and its kind
        self.last_step_stats = CommStats()
        self.last_step_kind: StepKind | None = None
        self._warned_step_path = False
        self.check_replicas_every = check_replicas_every
        self._syncs_since_check = 0
        #: what each rank sends and what the combined results become (hook and step() alike)
        self.messages = Messages(self)
        for group in self.param_groups:
            self._check_group(group)

    # ------------------------------------------------------------------ subclass interface
    def _initial_schedule(self) -> dict[str, Any]:
        return {}

    def next_step_kind(self) -> StepKind:
        """The kind of the coming step (a pure function of the schedule state)."""
        raise NotImplementedError

    def _advance_schedule(self, kind: StepKind) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ groups and validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "schedule"):  # not during __init__
            self._check_group(self.param_groups[-1])
            self.flat_cache.clear()
            self._group_of = None

    def _check_group(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            if p.is_sparse:
                raise ValueError(f"{type(self).__name__} does not support sparse parameters")
            if p.is_complex():
                raise ValueError(
                    f"{type(self).__name__} does not support complex parameters; use torch.view_as_real on them"
                )
        mask = group.get("exp_avg_mask")
        if mask is not None and not isinstance(mask, Tensor):
            raise ValueError("exp_avg_mask must be a tensor broadcastable to every parameter of its group")

    def trainable_params(self) -> list[tuple[dict[str, Any], Tensor]]:
        """``(group, param)`` for every parameter that requires a gradient, in group order."""
        return [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]

    def group_of(self, p: Tensor) -> dict[str, Any]:
        """The parameter group that holds ``p``."""
        if self._group_of is None:
            self._group_of = {id(q): g for g in self.param_groups for q in g["params"]}
        try:
            return self._group_of[id(p)]
        except KeyError:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} is not managed by this {type(self).__name__}; "
                "pass all trainable parameters of the model to the optimizer"
            ) from None

    def grouped(self, params: Sequence[Tensor], values: Sequence[Any]) -> list[tuple[dict[str, Any], list, list]]:
        """``(group, params, values)`` per parameter group of ``params``, in order of first appearance."""
        return _by_group([(self.group_of(p), p, v) for p, v in zip(params, values)])

    @property
    def comm_stats(self) -> CommStats:
        """Cumulative bytes and collectives this rank has sent (see :class:`CommStats`)."""
        return self.comm.stats

    # ------------------------------------------------------------------ coefficients
    def _coefficients(self, group: dict[str, Any], kind: StepKind) -> tuple[float, float]:
        """``(c1, c2)``: bias corrections of m and v for the coming step (1 when disabled)."""
        if not group["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = group["betas"]
        t = self.schedule["step"] + 1
        k = self.schedule["variance_updates"] + (1 if kind is StepKind.EXACT else 0)
        c2 = 1.0 - beta2**k if k > 0 else 1.0
        return 1.0 - beta1**t, c2

    def _denominators(self, group: dict[str, Any], params: Sequence[Tensor], kind: StepKind, c2: float) -> list[Tensor]:
        """``sqrt(v / c2) + eps``; after the freeze ``v`` follows the gradient's scale (:mod:`._grad_scale`)."""
        factors = None
        if self.follow_gradient_scale and kind in (StepKind.ONEBIT_MOMENTUM, StepKind.LOCAL, StepKind.ONEBIT_SYNC):
            updates = self.schedule.get("grad_sq_updates", 0)
            factors = []
            for p in params:
                f = _grad_scale.factor(self.state[p], group["betas"][1], updates, group["bias_correction"])
                factors.append(None if f is None else f.clamp(max=1.0))  # only ever lets v shrink
        return F.denominators([self.state[p]["exp_avg_sq"] for p in params], c2, group["eps"], factors)

    # ------------------------------------------------------------------ preparation
    def prepare_step(self) -> StepKind:
        """Make the state ready for the coming step and return its kind. Idempotent per step.

        Called by :meth:`step` and by the DDP hook before it computes messages.
        """
        kind = self.next_step_kind()
        if self._prepared_step == self.schedule["step"]:
            return kind
        for _, p in self.trainable_params():
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if (kind.compressed or kind is StepKind.LOCAL) and not self.schedule["masks_ready"]:
            _masks.build_masks(self.trainable_params(), lambda p: self.state[p], self.auto_momentum_mask)
            self.schedule["masks_ready"] = True
            self.flat_cache.clear()
        if kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC):
            if not self.schedule.get("local_phase_started", True):
                _local_phase.start_local_phase([p for _, p in self.trainable_params()], lambda p: self.state[p])
                self.schedule["local_phase_started"] = True
        elif "local_phase_started" in self.schedule:
            # Back before the local phase (e.g. var_freeze_step raised): its state is stale, and
            # entering the local phase again must start from the parameters of that moment.
            self.schedule["local_phase_started"] = False
        self._prepared_step = self.schedule["step"]
        self._stats_at_step_start = self.comm.stats.copy()
        return kind

    def flat_buffers(self, params: Sequence[Tensor]) -> FlatBuffers:
        """Flat error buffers for ``params`` in this order (cached per order; see :mod:`._flat`)."""
        return self.flat_cache.get(params)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of tensor storage this optimizer holds, by role (see :func:`._memory.state_bytes`)."""
        return _memory.state_bytes(self)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step (communicating first unless a DDP hook already did)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kind = self.prepare_step()
        hook_done = self.communicated_step == self.schedule["step"]
        if kind.communicates_in_backward and not hook_done:
            if self.comm.is_distributed and not self._warned_step_path:
                self._warned_step_path = True
                warnings.warn(
                    f"{type(self).__name__} communicates in step() because no hf_zeroone DDP hook ran this "
                    "step. That is right without DDP; but if the model is wrapped in DistributedDataParallel "
                    "(e.g. by transformers.Trainer), DDP already averaged the gradients in fp32 and no "
                    "bandwidth is saved: use hf_zeroone.ZeroOneTrainer, "
                    "hf_zeroone.integrations.prepare_zeroone or hf_zeroone.register_zeroone_hook.",
                    UserWarning,
                    stacklevel=user_stacklevel(),  # the user's line, whatever wraps step()
                )
            updates = exchange(self, kind)
        else:  # the hook's results, or local gradients
            updates = [(g, p, p.grad) for g, p in self.trainable_params() if p.grad is not None]
            if kind is StepKind.ONEBIT_MOMENTUM and hook_done:
                updates = [(g, p, self.messages.undo_norm_proxy(p, v)) for g, p, v in updates]
        self.messages.contain_spikes()
        for _, _, value in updates:
            if value.is_sparse:
                raise ValueError(f"{type(self).__name__} does not support sparse gradients")
        if not all_finite(v for _, _, v in updates):
            if kind.communicates_in_backward:
                # Every rank holds the same combined values, so every rank skips together.
                warnings.warn(
                    f"{type(self).__name__}: non-finite values after communication at step "
                    f"{self.schedule['step']} ({kind.value}); step skipped on all ranks, state unchanged",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.communicated_step = None
                return loss
            raise RuntimeError(
                f"{type(self).__name__}: non-finite local gradient on a local step (step "
                f"{self.schedule['step']}); ranks cannot agree to skip without communicating. "
                "Lower the learning rate, clip gradients, or use a GradScaler with "
                "ZeroOneHookState.overflow_check_on_local_steps=True."
            )
        self.grad_scale.fold(
            kind, updates, lambda p: self.state.get(p, {}), self.group_of, self.schedule, self.follow_gradient_scale
        )
        self._apply(kind, updates)
        if kind is StepKind.ONEBIT_SYNC:
            _local_phase.sync(self, exchange(self, kind))
        if kind is StepKind.EXACT:
            self.schedule["variance_updates"] += 1
        if kind.communicates and self.schedule["masks_ready"] and self.auto_momentum_mask:
            changed = _masks.release_masked_rows(
                self.trainable_params(), lambda p: self.state[p], kind is StepKind.EXACT, self._agree
            )
            self.flat_cache.refresh_masks(changed)
        self.last_step_stats = self.comm.stats - self._stats_at_step_start
        self.last_step_kind = kind
        self._advance_schedule(kind)
        self.schedule["step"] += 1
        self.communicated_step = None
        if self.check_replicas_every and kind.communicates:
            self._syncs_since_check += 1
            if self._syncs_since_check >= self.check_replicas_every:
                self._syncs_since_check = 0
                self.comm.assert_identical(
                    [p for _, p in self.trainable_params()], f"parameters after step {self.schedule['step']}"
                )
        return loss

    def _agree(self, flags: Tensor) -> Tensor:
        """The mean over ranks of every rank's ``flags`` (the rows each rank saw a gradient in)."""
        return self.comm.allreduce_mean(flags) if self.comm.is_distributed else flags

    def _apply(self, kind: StepKind, updates: list[tuple[dict[str, Any], Tensor, Tensor]]) -> None:
        """Update every parameter and its state from its combined result (or its local gradient)."""
        local = kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC)
        for group, params, values in _by_group(updates):
            lr, wd = group["lr"], group["weight_decay"]
            c1, c2 = self._coefficients(group, kind)
            decay = 1.0 - lr * wd if group["decoupled_weight_decay"] else 1.0
            grads = [v.to(p.dtype) for p, v in zip(params, values)]
            # An implied gradient (ONEBIT_MOMENTUM) already carries the L2 term of the message.
            if kind is not StepKind.ONEBIT_MOMENTUM and wd and not group["decoupled_weight_decay"]:
                grads = F.l2_gradients(grads, params, wd)
            states = [self.state[p] for p in params]
            if local:
                grads = _masks.mask_local_gradients(states, grads, [v.to(p.dtype) for p, v in zip(params, values)])
            dens = F.adam_update(
                params,
                grads,
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                lr=lr,
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                c1=c1,
                decay=decay,
                update_variance=kind is StepKind.EXACT,
                make_denominators=lambda group=group, params=params, c2=c2: self._denominators(group, params, kind, c2),
            )
            if local:
                _local_phase.note_local_step(states, dens, lr, c1, decay)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; also forgets a hook's results never stepped on.

        After a step that was not taken (a GradScaler skip), the next gradients must not be taken
        for combined results unless the hook runs again.
        """
        self.communicated_step = None
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ checkpoints (see ._checkpoint)
    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state plus the schedule counters and this rank's identity (see :mod:`._checkpoint`)."""
        return _checkpoint.add_extra(super().state_dict(), self)

    def defer_rank_state(self, state_dict: dict[str, Any]) -> None:
        """Make the next :meth:`load_state_dict` load ``state_dict`` instead of the state it is given.

        For frameworks that hand every rank the state saved by rank 0 (``accelerate``'s
        ``load_state``): each rank defers its own saved state first, keeping its error buffers.
        """
        self._deferred_state = state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; error buffers from another world size or rank are reset.

        Checkpoints of earlier versions, whose ``server_error`` entries are full-size, load too.
        """
        deferred, self._deferred_state = getattr(self, "_deferred_state", None), None
        plain, restore = _checkpoint.split_for_torch(self, deferred if deferred is not None else state_dict)
        super().load_state_dict(plain)
        restore()
        self.flat_cache.clear()
        self._prepared_step = -1
        self.communicated_step = None
