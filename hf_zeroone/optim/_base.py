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

The 1-bit kinds ``ONEBIT_GRADIENT`` and ``ONEBIT_MOMENTUM`` send their message divided by
per-element weights derived from ``v`` (the same on every rank) and multiply the combined result
back (:meth:`CompressedAdamBase.compression_weight`): an element whose variance is far below its
tensor's is compressed in units of its update, so its compression error cannot become a step of
many thousand learning rates. ``ONEBIT_SYNC``'s
``u`` is a parameter displacement, already in those units.

The first three kinds communicate gradient-like messages that are ready when backward ends, so
the DDP hook sends them during backward. ``ONEBIT_SYNC`` is a local step followed by a sync of
``u``; since ``u`` needs this step's (possibly clipped) gradient, it is sent in ``step()``, after
backward and clipping, by every path. Only sync steps (one in up to ``local_step_clipper`` steps
of 0/1 Adam's local phase) lose the overlap with backward.

For ``ONEBIT_MOMENTUM`` the combined momentum ``m'`` is turned into the gradient it implies,
``g = (m' - beta1 * m) / (1 - beta1)`` (:meth:`CompressedAdamBase.implied_gradient`), identical on
every rank; ``m <- beta1 * m + (1 - beta1) * g`` then gives back ``m'``. That ``g`` carries the
1-bit compression noise times ``1 / (1 - beta1)``: its norm can be 10-20 times the true gradient's,
and a clipping threshold meant for gradients would cut every step. So ``g`` is handed on rescaled,
per tensor, to the root mean square over ranks of the local gradients' norms (exact: one float per
tensor, averaged alongside), :meth:`CompressedAdamBase.norm_proxy`; ``step()`` divides the factor
out again. Unclipped, the step reproduces ``m'``; clipped by ``s``, the step's gradient
contribution is ``s * g``, so clipping sees a gradient-sized norm and still damps a real spike.
On every other step that communicates, ``p.grad`` after a DDP hook is an averaged gradient.

The messages are computed by :meth:`CompressedAdamBase.write_message` and the results applied by
:meth:`CompressedAdamBase.step`. Two callers compute messages: ``step`` itself when nobody
communicated during backward (no DDP, or DDP without our hook), and the DDP communication hook
(:mod:`hf_zeroone.ddp_hook`), which writes them into DDP's gradient buckets during backward and
hands the results back as ``p.grad``. Both go through the same two methods, so the maths exists
once.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from hf_zeroone._tensors import all_finite
from hf_zeroone.comm import CommStats, Communicator
from hf_zeroone.optim import _grad_scale, _masks, _memory
from hf_zeroone.optim._checkpoint import CheckpointMixin
from hf_zeroone.optim._flat import FlatBuffers, build_flat_buffers
from hf_zeroone.optim._grad_scale import GradScaleMixin
from hf_zeroone.optim._local_phase import LocalPhaseMixin
from hf_zeroone.optim._masks import MomentumMaskMixin
from hf_zeroone.optim._step_kind import StepKind, _check_fraction, _check_int
from hf_zeroone.optim._step_path import StepPathMixin

__all__ = ["CompressedAdamBase", "FlatBuffers", "StepKind"]

#: elements with ``sqrt(v) + eps`` below this fraction of their tensor's mean are compressed in
#: units of their update (see :meth:`CompressedAdamBase.compression_weight`)
_UPDATE_UNITS_BELOW = 0.1


def _user_stacklevel() -> int:
    """``stacklevel`` that points a warning raised by this module's caller at the user's code.

    Skips the frames of torch, hf_zeroone, accelerate and transformers (their wrappers around
    ``step()`` differ between versions); level 1 is the caller of this function.
    """
    skip = tuple(
        os.path.dirname(module.__file__) + os.sep
        for name in ("torch", "hf_zeroone", "accelerate", "transformers")
        if (module := sys.modules.get(name)) is not None and getattr(module, "__file__", None)
    )
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


class CompressedAdamBase(StepPathMixin, LocalPhaseMixin, MomentumMaskMixin, GradScaleMixin, CheckpointMixin, Optimizer):
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
        if isinstance(lr, Tensor) or not isinstance(lr, (int, float)) or not lr >= 0.0:
            raise ValueError(f"lr must be a float >= 0, got {lr!r}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        _check_fraction("betas[0]", betas[0])
        _check_fraction("betas[1]", betas[1])
        if not (isinstance(eps, (int, float)) and eps >= 0.0):
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0.0):
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
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
        self._flat_cache: dict[tuple[int, ...], FlatBuffers] = {}
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
        #: per parameter, the factor :meth:`norm_proxy` applied to this step's implied gradient and
        #: the norm it handed on
        self._norm_proxy_factors: dict[Tensor, tuple[Tensor, Tensor]] = {}
        #: per parameter, this step's mean over ranks of :meth:`scale_samples` and the norm handed
        #: on as ``p.grad`` (``None``: handed on unclipped), for :mod:`._grad_scale`
        self._grad_sq_samples: dict[Tensor, tuple[Tensor, Tensor | None]] = {}
        #: per parameter, the fraction of the implied gradient's norm that clipping kept this step
        self._kept_fraction: dict[Tensor, Tensor] = {}
        #: per parameter, the fraction of the handed-on norm that clipping left (see _contain_spikes)
        self._clip_fractions: list[tuple[Tensor, Tensor]] = []
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
            self._flat_cache.clear()
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

    @property
    def comm_stats(self) -> CommStats:
        """Cumulative bytes and collectives this rank has sent (see :class:`CommStats`)."""
        return self.comm.stats

    # ------------------------------------------------------------------ per-step maths
    def _coefficients(self, group: dict[str, Any], kind: StepKind) -> tuple[float, float]:
        """``(c1, c2)``: bias corrections of m and v for the coming step (1 when disabled)."""
        if not group["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = group["betas"]
        t = self.schedule["step"] + 1
        k = self.schedule["variance_updates"] + (1 if kind is StepKind.EXACT else 0)
        c2 = 1.0 - beta2**k if k > 0 else 1.0
        return 1.0 - beta1**t, c2

    @staticmethod
    def _l2_gradient(group: dict[str, Any], p: Tensor, grad: Tensor) -> Tensor:
        """The gradient plus ``wd * p`` when weight decay is L2 (not decoupled)."""
        wd = group["weight_decay"]
        if wd and not group["decoupled_weight_decay"]:
            return grad.add(p, alpha=wd)
        return grad

    def write_message(self, group: dict[str, Any], p: Tensor, grad: Tensor | None, kind: StepKind, out: Tensor) -> None:
        """Write what this rank sends for ``p`` in a ``kind`` step into ``out`` (fp32, shaped like p).

        Reads the optimizer state and leaves it unchanged, except for noting which masked rows
        received a gradient: a step that is later skipped (non-finite gradients, a GradScaler
        overflow) leaves no other trace.
        """
        if grad is None:
            grad = torch.zeros_like(p)
        if kind in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM):
            _masks.note_activity(self.state[p], grad)
        if kind.message_is_gradient:
            out.copy_(grad)
            return
        state = self.state[p]
        if kind is StepKind.ONEBIT_SYNC:  # sent after this step's local update
            self._displacement(p, out)
            return
        beta1 = group["betas"][0]
        g = self._l2_gradient(group, p, grad)
        m = state["exp_avg"]
        if m.dtype == out.dtype and g.dtype == out.dtype:
            torch.lerp(m, g, 1.0 - beta1, out=out)  # one pass; the same operation as the update in _apply
        else:
            out.copy_(m).lerp_(g.to(out.dtype), 1.0 - beta1)

    def compression_weight(self, group: dict[str, Any], p: Tensor) -> Tensor:
        r"""Per-element weights ``w = min(1, d / (0.1 * mean(d)))``, ``d = sqrt(v) + eps``, in float32.

        A 1-bit gradient or momentum message is divided by ``w`` before compression and the
        combined result multiplied by it after (:meth:`to_update_units`, :meth:`from_update_units`).
        The update of element ``j`` is ``lr * m_j / d_j``, so one sign and one segment scale cost it
        ``lr * scale / d_j``: for an element whose variance is orders of magnitude below its
        tensor's (an attention key bias, whose exact gradient is zero, has ``d_j`` near ``eps``)
        that is a step of up to :math:`10^5` learning rates. With the weights, such an element is
        compressed in units of its update instead, and its error is at most that of an element
        with ``d = 0.1 * mean(d)``; elements at or above that (``w = 1``) are compressed as they
        are. Fully in update units (``w = d``) 1-bit Adam ended 32% above AdamW on the BPE GPT-2
        run of ``recipes/convergence.py`` (every element then moves by the segment's scale at
        every step); with this floor, +0.85% (raw units: +1.96%). ``v`` is the same on every rank,
        so every rank uses the same weights, and while ``v`` is frozen error feedback stays exact.
        """
        d = self.state[p]["exp_avg_sq"].to(torch.float32).sqrt().add_(group["eps"])
        return d.div_(d.mean() * _UPDATE_UNITS_BELOW).clamp_(max=1.0)

    def to_update_units(self, group: dict[str, Any], p: Tensor, kind: StepKind, message: Tensor) -> None:
        """Divide a 1-bit gradient or momentum message by :meth:`compression_weight`, in place."""
        if kind in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM):
            message.div_(self.compression_weight(group, p))

    def from_update_units(self, group: dict[str, Any], p: Tensor, kind: StepKind, combined: Tensor) -> None:
        """Undo :meth:`to_update_units` on the combined result, in place."""
        if kind in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM):
            combined.mul_(self.compression_weight(group, p))

    def implied_gradient(self, group: dict[str, Any], p: Tensor, combined_momentum: Tensor) -> Tensor:
        """Turn a combined momentum into the gradient it implies, in place in ``combined_momentum``.

        ``g = (m' - beta1 * m) / (1 - beta1)``, so that ``beta1 * m + (1 - beta1) * g == m'``. Computed
        in one pass as ``m + (m' - m) / (1 - beta1)`` (a lerp from ``m`` past ``m'``).
        """
        beta1 = group["betas"][0]
        m = self.state[p]["exp_avg"].to(combined_momentum.dtype)
        return torch.lerp(m, combined_momentum, 1.0 / (1.0 - beta1), out=combined_momentum)

    def norm_proxy(self, params: Sequence[Tensor], implied: Sequence[Tensor], mean_sq_norms: Tensor) -> None:
        """Rescale each implied gradient in place to a gradient-sized norm; :meth:`step` undoes it.

        ``mean_sq_norms[i]`` is the mean over ranks of ``||g_i||^2`` for ``params[i]`` (exact), so the
        norm a clipping function sees is the root mean square of the ranks' local gradient norms.
        """
        for p, view, mean_sq in zip(params, implied, mean_sq_norms):
            norm = torch.linalg.vector_norm(view)
            ok = (norm > 0) & (mean_sq > 0) & torch.isfinite(norm)
            factor = torch.where(ok, mean_sq.sqrt() / norm, torch.ones_like(norm))
            view.mul_(factor)
            self._norm_proxy_factors[p] = (factor, torch.where(ok, mean_sq.sqrt(), norm))

    @staticmethod
    def local_sq_norms(grads: Sequence[Tensor | None]) -> Tensor:
        """``||g||^2`` of each local gradient (0 for ``None``), as one float32 vector."""
        device = next((g.device for g in grads if g is not None), torch.device("cpu"))
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack(
            [zero if g is None else torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads]
        )

    def _apply(self, group: dict[str, Any], p: Tensor, result: Tensor, kind: StepKind) -> None:
        """Update ``p`` and its state from the combined ``result`` (or the local gradient)."""
        state = self.state[p]
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        c1, c2 = self._coefficients(group, kind)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        decay = 1.0 - lr * wd if group["decoupled_weight_decay"] else 1.0
        result = result.to(p.dtype)

        # An implied gradient (ONEBIT_MOMENTUM) already carries the L2 term of the message.
        g = result if kind is StepKind.ONEBIT_MOMENTUM else self._l2_gradient(group, p, result)
        if kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC) and "momentum_mask" in state:
            _masks.note_activity(state, result)
            # Masked elements stay out of local steps as they stay out of compression: their
            # momentum stays zero. (Their v is usually zero too, so m / (sqrt(v) + eps) would
            # move them by up to lr * (1 - beta1) * g / eps, and every sync would undo it.)
            g = g * state["momentum_mask"]
        exp_avg.lerp_(g, 1.0 - beta1)
        if kind is StepKind.EXACT:
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        if decay != 1.0:
            p.mul_(decay)
        denom = self._denominator(group, p, kind, c2)
        p.addcdiv_(exp_avg, denom, value=-lr / c1)
        if kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC):
            if "update_accumulator" in state:  # low-precision parameters, see _displacement
                state["update_accumulator"].addcdiv_(exp_avg, denom, value=lr / c1)
            state["lr_sum"] += lr
            state["decay_prod"] *= decay

    def _denominator(self, group: dict[str, Any], p: Tensor, kind: StepKind, c2: float) -> Tensor:
        """``sqrt(v / c2) + eps``; after the freeze ``v`` follows the gradient's scale (:mod:`._grad_scale`)."""
        exp_avg_sq = self.state[p]["exp_avg_sq"]
        f = None
        if self.follow_gradient_scale and kind in (StepKind.ONEBIT_MOMENTUM, StepKind.LOCAL, StepKind.ONEBIT_SYNC):
            f = _grad_scale.factor(
                self.state[p], group["betas"][1], self.schedule.get("grad_sq_updates", 0), group["bias_correction"]
            )
        if f is not None:
            f = f.clamp(max=1.0)  # only ever lets v shrink, see ._grad_scale
        if f is None:
            return exp_avg_sq.sqrt().div_(math.sqrt(c2)).add_(group["eps"])
        return exp_avg_sq.sqrt().mul_(torch.sqrt(f.to(exp_avg_sq.dtype) / c2)).add_(group["eps"])

    # ------------------------------------------------------------------ preparation
    def _init_state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def prepare_step(self) -> StepKind:
        """Make the state ready for the coming step and return its kind. Idempotent per step.

        Called by :meth:`step` and by the DDP hook before it computes messages.
        """
        kind = self.next_step_kind()
        if self._prepared_step == self.schedule["step"]:
            return kind
        for _, p in self.trainable_params():
            self._init_state(p)
        if (kind.compressed or kind is StepKind.LOCAL) and not self.schedule["masks_ready"]:
            self._build_momentum_masks()
        if kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC):
            if not self.schedule.get("local_phase_started", True):
                self._start_local_phase()
        elif "local_phase_started" in self.schedule:
            # Back before the local phase (e.g. var_freeze_step raised): its state is stale, and
            # entering the local phase again must start from the parameters of that moment.
            self.schedule["local_phase_started"] = False
        self._prepared_step = self.schedule["step"]
        self._stats_at_step_start = self.comm.stats.copy()
        return kind

    # ------------------------------------------------------------------ flat buffers
    def flat_buffers(self, params: Sequence[Tensor]) -> FlatBuffers:
        """Flat error buffers for ``params`` in this order (cached per order; see :mod:`._flat`).

        The first call for an order (e.g. after DDP rebuilt its buckets) moves each parameter's
        error state into new flat storage, makes the state entries views of it, and frees the
        cached buffers of any other order that shares a parameter with it.
        """
        key = tuple(id(p) for p in params)
        entry = self._flat_cache.get(key)
        if entry is not None and all(
            self.state[p].get("worker_error") is view for p, view in zip(entry.params, entry.worker_error_views)
        ):
            return entry
        ids = set(key)
        for other in [k for k in self._flat_cache if ids.intersection(k)]:
            del self._flat_cache[other]  # its storage backs no state once the new entry is built
        entry = build_flat_buffers(
            params, lambda p: self.state[p], self.comm.world_size, self.comm.rank, type(self).__name__
        )
        self._flat_cache[key] = entry
        return entry

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
                    stacklevel=_user_stacklevel(),  # the user's line, whatever wraps step()
                )
            updates = self._exchange(kind)
        else:  # the hook's results, or local gradients
            updates = [(g, p, p.grad) for g, p in self.trainable_params() if p.grad is not None]
            if kind is StepKind.ONEBIT_MOMENTUM and hook_done:
                updates = [(g, p, self._undo_norm_proxy(p, v)) for g, p, v in updates]
        self._contain_spikes()
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
        self._sample_grad_scale(kind, updates)
        for group, p, value in updates:
            self._apply(group, p, value, kind)
        if kind is StepKind.ONEBIT_SYNC:
            synced = self._exchange(kind)
            if all_finite(v for _, _, v in synced):
                for group, p, value in synced:
                    self._apply_sync(group, p, value, kind)
            else:
                # The combined u is identical on every rank, so every rank takes this branch.
                warnings.warn(
                    f"{type(self).__name__}: non-finite values in the sync at step {self.schedule['step']}: "
                    "the local steps since the last sync are discarded on all ranks (parameters back to the "
                    "last synced values, momentum reset). Lower the learning rate or clip gradients if it repeats.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                for _, p, _ in synced:
                    self._discard_interval(p)
        if kind is StepKind.EXACT:
            self.schedule["variance_updates"] += 1
        if kind.communicates and self.schedule["masks_ready"] and self.auto_momentum_mask:
            self._release_masked_rows(kind)
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; also forgets a hook's results never stepped on.

        After a step that was not taken (a GradScaler skip), the next gradients must not be taken
        for combined results unless the hook runs again.
        """
        self.communicated_step = None
        super().zero_grad(set_to_none=set_to_none)
