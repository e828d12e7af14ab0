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

import enum
import functools
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
from hf_zeroone.optim._flat import (
    ERROR_STATE,
    FlatBuffers,
    build_flat_buffers,
    consecutive_views,
    refresh_layout,
    restore_errors,
    split_in_buckets,
)

__all__ = ["CompressedAdamBase", "FlatBuffers", "StepKind"]

_STATE_KEY = "hf_zeroone"
#: clipping that keeps less than this fraction of 1-bit Adam's implied gradient is treated as a
#: spike: the error buffers are scaled with it (see CompressedAdamBase._undo_norm_proxy)
_SPIKE_CLIP = 0.1
#: elements with ``sqrt(v) + eps`` below this fraction of their tensor's mean are compressed in
#: units of their update (see :meth:`CompressedAdamBase.compression_weight`)
_UPDATE_UNITS_BELOW = 0.1
#: state entries kept in float32 whatever the parameter's dtype (error feedback)
_FP32_STATE = ("worker_error", "server_error")
#: state entries restored as float32 by load_state_dict (torch would cast them to the parameter's dtype)
_FP32_ON_LOAD = ERROR_STATE + _grad_scale.STATE_KEYS


def _kept(ratio: Tensor) -> Tensor:
    """The fraction of a gradient's norm that clipping kept: exactly 1 unless it was cut.

    ``ratio`` is the norm after clipping over the norm handed on; two norms of the same values
    can differ in the last bit (a different summation order), which must not count as clipping.
    """
    return torch.where(ratio > 1.0 - 1e-5, torch.ones_like(ratio), ratio)


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


class StepKind(enum.Enum):
    """What one optimizer step communicates (see the module docstring)."""

    EXACT = "exact"
    ONEBIT_GRADIENT = "onebit_gradient"
    ONEBIT_MOMENTUM = "onebit_momentum"
    LOCAL = "local"
    ONEBIT_SYNC = "onebit_sync"

    @property
    def communicates(self) -> bool:
        return self is not StepKind.LOCAL

    @property
    def communicates_in_backward(self) -> bool:
        """True when the message is ready when backward ends (a DDP hook can send it)."""
        return self in (StepKind.EXACT, StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM)

    @property
    def compressed(self) -> bool:
        return self in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM, StepKind.ONEBIT_SYNC)

    @property
    def message_is_gradient(self) -> bool:
        """True when a rank's message is its raw gradient (what DDP's bucket already holds)."""
        return self in (StepKind.EXACT, StepKind.ONEBIT_GRADIENT)


def _check_fraction(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


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

    def scale_samples(self, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> Tensor:
        """Each local gradient's squared norm once normalised by the current variance, as one float32 vector.

        ``sum_j g_j^2 / (sqrt(v_j / c2) + eps)^2`` over the elements with a variance (``v_j > 0``): how
        large the gradient is *relative to* what ``v`` expects, element by element, so that a few
        elements with large gradients do not speak for the whole tensor. Averaged over ranks, it
        is the sample of :mod:`hf_zeroone.optim._grad_scale`.
        """
        out = []
        for p, g in zip(params, grads):
            state = self.state.get(p, {})
            v = state.get("exp_avg_sq")
            if g is None or v is None:
                out.append(torch.zeros((), dtype=torch.float32, device=p.device))
                continue
            group = self.group_of(p)
            k = self.schedule["variance_updates"]
            c2 = 1.0 - group["betas"][1] ** k if group["bias_correction"] and k > 0 else 1.0
            v = v.float()
            normalised = g.float() / v.div(c2).sqrt_().add_(group["eps"])
            out.append(torch.where(v > 0, normalised.square_(), 0.0).sum())
        return torch.stack(out)

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

    def record_grad_sq(
        self, params: Sequence[Tensor], mean_sq_norms: Tensor, handed_norms: Sequence[Tensor] | None = None
    ) -> None:
        """Note this step's mean over ranks of each :meth:`scale_samples` (and the norms handed on as ``p.grad``).

        Called by whoever combined the gradients (``step()`` or the DDP hook) on the steps that
        sample the gradient's scale (see :mod:`hf_zeroone.optim._grad_scale`).
        """
        for i, p in enumerate(params):
            self._grad_sq_samples[p] = (mean_sq_norms[i], None if handed_norms is None else handed_norms[i])

    def _sample_grad_scale(self, kind: StepKind, updates: list[tuple[dict[str, Any], Tensor, Tensor]]) -> None:
        """Fold this step's gradient scale into each tensor's running mean square (before the update)."""
        samples, self._grad_sq_samples = self._grad_sq_samples, {}
        kept_fractions, self._kept_fraction = self._kept_fraction, {}
        if not self.follow_gradient_scale or kind is StepKind.ONEBIT_GRADIENT or self.schedule["variance_updates"] == 0:
            return  # v is not updated on these steps; before the first update there is no v to compare with
        count = self.schedule.get("grad_sq_updates", 0) + 1
        self.schedule["grad_sq_updates"] = count
        for group, p, value in updates:
            if kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC):  # this rank's own gradient, as used
                mean_sq, handed = self.scale_samples([p], [value])[0], None
            elif p in samples:
                mean_sq, handed = samples[p]
            else:
                continue
            kept: Tensor | float = 1.0
            if p in kept_fractions:
                kept = kept_fractions[p]
            elif handed is not None:  # clipped after the hook handed it on
                norm = torch.linalg.vector_norm(value, dtype=torch.float32)
                kept = _kept(norm / torch.where(handed > 0, handed, 1.0))
            _grad_scale.sample(
                self.state[p],
                p,
                mean_sq,
                kept,
                group["betas"][1],
                count,
                group["bias_correction"],
                variance_step=kind is StepKind.EXACT,
            )

    @staticmethod
    def _accumulates_displacement(p: Tensor) -> bool:
        """Whether ``p`` keeps 0/1 Adam's ``u`` in a buffer instead of deriving it (see :meth:`_displacement`)."""
        return p.dtype not in (torch.float32, torch.float64)

    def _displacement(self, p: Tensor, out: Tensor) -> None:
        """0/1 Adam's ``u`` for ``p`` into ``out`` (fp32): what the local steps since the last sync moved it.

        Derived as ``u = decay_prod * sync_param - p`` (no buffer held): a sync then sets
        ``p = decay_prod * sync_param - u_avg``, which without compression is exactly where the
        local steps left ``p``. A parameter below fp32 (bf16, fp16) accumulates ``u`` in a buffer
        instead, since each local step's rounding of ``p`` to its own precision would drop updates
        the accumulator keeps.
        """
        state = self.state[p]
        if "update_accumulator" in state:
            out.copy_(state["update_accumulator"])
        elif p.dtype == out.dtype:
            torch.mul(state["sync_param"], state["decay_prod"], out=out).sub_(p)
        else:
            out.copy_(state["sync_param"].mul(state["decay_prod"]).sub_(p))

    def _apply_sync(self, group: dict[str, Any], p: Tensor, combined_u: Tensor, kind: StepKind) -> None:
        """Back to the last synced parameters, then the averaged accumulated update (in parameter space)."""
        state = self.state[p]
        c1, c2 = self._coefficients(group, kind)
        combined_u = combined_u.to(p.dtype)
        p.copy_(state["sync_param"]).mul_(state["decay_prod"]).sub_(combined_u)
        if state["lr_sum"] > 0:
            denom = self._denominator(group, p, kind, c2)
            state["exp_avg"].copy_(combined_u).mul_(denom).mul_(c1 / state["lr_sum"])
        if "update_accumulator" in state:
            if self._accumulates_displacement(p):
                state["update_accumulator"].zero_()
            else:  # derived from now on (a checkpoint of an earlier version brought one)
                del state["update_accumulator"]
        state["sync_param"].copy_(p)
        state["lr_sum"], state["decay_prod"] = 0.0, 1.0

    def _discard_interval(self, p: Tensor) -> None:
        """Back to the last synced parameters with zero momentum: identical and finite on every rank."""
        state = self.state[p]
        p.copy_(state["sync_param"])
        state["exp_avg"].zero_()
        if "update_accumulator" in state:
            state["update_accumulator"].zero_()
        state["lr_sum"], state["decay_prod"] = 0.0, 1.0

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

    def _build_momentum_masks(self) -> None:
        """Fix, once, which elements take part in compression (see ``auto_momentum_mask``)."""
        for group, p in self.trainable_params():
            state = self.state[p]
            mask = None
            if self.auto_momentum_mask:
                nonzero = state["exp_avg_sq"] != 0
                if not bool(nonzero.all()):
                    mask = nonzero
            user = group.get("exp_avg_mask")
            if user is not None:
                user_mask = torch.broadcast_to(user.to(p.device) != 0, p.shape)
                mask = user_mask if mask is None else mask & user_mask
            if mask is not None:
                state["momentum_mask"] = mask.clone()
        self.schedule["masks_ready"] = True
        self._flat_cache.clear()

    def _release_masked_rows(self, kind: StepKind) -> None:
        """Unmask the rows that received a gradient on any rank (see :mod:`hf_zeroone.optim._masks`)."""
        masked = [(g, p, self.state[p]) for g, p in self.trainable_params() if "momentum_mask" in self.state[p]]
        if not masked:
            return
        if kind is StepKind.EXACT:  # exact gradients updated v: it says which rows had one
            released = [_masks.released_by_variance(s) for _, _, s in masked]
        else:
            flags = [_masks.activity_flags(s) for _, _, s in masked]
            agreed = torch.cat(flags)
            if self.comm.is_distributed:
                agreed = self.comm.allreduce_mean(agreed)
            released = [
                _masks.scatter_flags(s, f) for (_, _, s), f in zip(masked, agreed.split([len(f) for f in flags]))
            ]
        everywhere = None  # mean known variance over all tensors, computed only if needed
        changed: set[int] = set()
        for (group, p, state), rows in zip(masked, released):
            _masks.clear_activity(state)
            if not bool(rows.any()):
                continue
            total, count = _masks.known_variance(state)
            if count == 0:  # no element of this tensor has a variance: the mean of all tensors
                if everywhere is None:
                    sums = [_masks.known_variance(self.state[q]) for _, q in self.trainable_params()]
                    n = sum(c for _, c in sums)
                    everywhere = sum(t for t, _ in sums) / n if n else 0.0
                total, count = everywhere, 1
            if total == 0.0:
                continue
            user = group.get("exp_avg_mask")
            user_mask = None if user is None else torch.broadcast_to(user.to(p.device) != 0, p.shape)
            _masks.release_rows(state, rows, user_mask, total / count)
            changed.add(id(p))
        for entry in self._flat_cache.values():  # same positions, new masks: the buffers stay
            if changed.intersection(map(id, entry.params)):
                refresh_layout(entry, lambda q: self.state[q])

    def _start_local_phase(self) -> None:
        """Entering local steps: remember the synced parameters, reset u and the error buffers."""
        for _, p in self.trainable_params():
            state = self.state[p]
            state["sync_param"] = p.detach().clone()
            if self._accumulates_displacement(p):
                state["update_accumulator"] = torch.zeros_like(p)
            else:
                state.pop("update_accumulator", None)
            state["lr_sum"], state["decay_prod"] = 0.0, 1.0
            # The errors so far belong to compressed gradients, not to u (as DeepSpeed does).
            for key in ("worker_error", "server_error"):
                if key in state:
                    state[key].zero_()
        self.schedule["local_phase_started"] = True

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
    def _exchange(self, kind: StepKind) -> list[tuple[dict[str, Any], Tensor, Tensor]]:
        """Compute every parameter's message and combine across ranks; no DDP hook involved."""
        pairs = self.trainable_params()
        if not pairs:
            return []
        params = [p for _, p in pairs]
        if not self.comm.is_distributed:
            # A single process sends nothing; the "combined" value is the message itself.
            results = []
            for group, p in pairs:
                if p.grad is None:
                    continue  # like torch.optim: a parameter without gradient is left alone
                out = torch.empty_like(p, dtype=torch.float32)
                self.write_message(group, p, p.grad, kind, out)
                if kind.compressed and "momentum_mask" in self.state[p]:
                    out.mul_(self.state[p]["momentum_mask"])  # as the compressed allreduce does
                if kind is StepKind.ONEBIT_MOMENTUM:
                    self.implied_gradient(group, p, out)
                results.append((group, p, out))
            if self.follow_gradient_scale and kind in (StepKind.EXACT, StepKind.ONEBIT_MOMENTUM) and results:
                used = [p for _, p, _ in results]
                self.record_grad_sq(used, self.scale_samples(used, [p.grad for p in used]))
            return results
        results: list[tuple[dict[str, Any], Tensor, Tensor]] = []
        for bucket in split_in_buckets(pairs, self.step_bucket_numel):  # one bucket's message at a time
            bucket_params = [p for _, p in bucket]
            if kind.compressed:
                flat = self.flat_buffers(bucket_params)
                message, views = flat.new_message(), flat.views
                message[flat.layout.numel :].zero_()
            else:
                numel = sum(p.numel() for p in bucket_params)
                message = torch.empty(numel, dtype=torch.float32, device=params[0].device)
                views = functools.partial(consecutive_views, bucket_params)
            for (group, p), view in zip(bucket, views(message)):
                self.write_message(group, p, p.grad, kind, view)
                self.to_update_units(group, p, kind, view)
            if kind.compressed:
                combined = self.comm.compressed_allreduce(message, flat.worker_error, flat.server_error, flat.layout)
            else:
                combined = self.comm.allreduce_mean(message)
            del message  # the compressed allreduce's scratch: freed before the next bucket
            for (group, p), view in zip(bucket, views(combined)):
                self.from_update_units(group, p, kind, view)
            results += [(group, p, view) for (group, p), view in zip(bucket, views(combined))]
        grads = [p.grad for p in params]
        if kind is StepKind.EXACT and self.follow_gradient_scale:
            self.record_grad_sq(params, self.comm.allreduce_mean(self.scale_samples(params, grads)))
        if kind is StepKind.ONEBIT_MOMENTUM:
            # one collective: the local squared norms (clipping), and the scale samples when asked for
            floats = self.local_sq_norms(grads)
            if self.follow_gradient_scale:
                floats = torch.cat([floats, self.scale_samples(params, grads)])
            floats = self.comm.allreduce_mean(floats.to(params[0].device))
            mean_sq = floats[: len(params)]
            if self.follow_gradient_scale:
                self.record_grad_sq(params, floats[len(params) :])
            for group, p, view in results:
                self.implied_gradient(group, p, view)
            self.norm_proxy(params, [v for _, _, v in results], mean_sq)  # as the hook does, so that
            # back into the combined buffer: one parameter's worth of scratch at a time
            results = [(g, p, v.copy_(self._undo_norm_proxy(p, v))) for g, p, v in results]  # both agree
        return results

    def _undo_norm_proxy(self, p: Tensor, value: Tensor) -> Tensor:
        """The implied gradient back from what :meth:`norm_proxy` handed on (and clipping left).

        If clipping cut it to less than ``_SPIKE_CLIP`` of its norm (a spike, not the routine
        clipping of a run whose gradients hover above the threshold), the error-feedback buffers
        of ``p`` are scaled by the same factor: they hold the rest of this step's message, and the
        spike left there would otherwise flow into the next steps' messages, past the clipping.
        Routine clipping leaves them alone: scaling them on every step discards the compression
        residuals error feedback needs. The fraction is noted here and acted on by
        :meth:`_contain_spikes`, which reads all of a step's fractions on the host at once.
        """
        entry = self._norm_proxy_factors.pop(p, None)
        if entry is None:
            return value
        factor, handed_norm = entry
        clipped = torch.linalg.vector_norm(value.float()) / handed_norm
        self._kept_fraction[p] = _kept(clipped)
        self._clip_fractions.append((p, clipped))
        return value / factor.to(value.dtype)

    def _contain_spikes(self) -> None:
        """Scale the error buffers of the parameters :meth:`_undo_norm_proxy` found spiked.

        One host read per step (a GPU sync), not one per parameter; per-parameter reads only on a
        step with a spike.
        """
        pending, self._clip_fractions = self._clip_fractions, []
        if not pending:
            return
        home = pending[0][1].device
        if not bool(torch.stack([f.to(home) for _, f in pending]).lt(_SPIKE_CLIP).any()):
            return
        for p, clipped in pending:
            if bool(clipped < _SPIKE_CLIP):
                state = self.state[p]
                for key in _FP32_STATE:
                    if key in state:
                        state[key].mul_(clipped)

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

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state plus the schedule counters and this rank's identity.

        Per-parameter state includes this rank's error buffers; save one file per rank to keep
        them (they differ between ranks): ``worker_error`` shaped like the parameter, and
        ``server_error``, one-dimensional, only the elements this rank serves, which start at
        element ``server_error_start`` of the flattened parameter (see :mod:`._flat`). Everything is
        plain tensors, numbers and strings, so it loads with ``torch.load(..., weights_only=True)``.
        """
        sd = super().state_dict()
        sd[_STATE_KEY] = {
            "optimizer": type(self).__name__,
            "schedule": dict(self.schedule),
            "hyperparameters": {name: getattr(self, name) for name in self.schedule_params},
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
        }
        return sd

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
        state_dict = dict(deferred if deferred is not None else state_dict)
        extra = state_dict.pop(_STATE_KEY, None)
        if extra is None:
            raise ValueError(
                f"this state dict was not saved by a hf_zeroone optimizer; {type(self).__name__} "
                "needs its schedule counters (start a fresh optimizer instead)"
            )
        if extra.get("optimizer") != type(self).__name__:
            raise ValueError(
                f"state dict was saved by {extra.get('optimizer')}, cannot load it into {type(self).__name__}"
            )
        saved = extra.get("hyperparameters", {})
        mine = {name: getattr(self, name) for name in self.schedule_params}
        differing = {name: (saved[name], mine[name]) for name in mine if name in saved and saved[name] != mine[name]}
        if differing:
            listing = ", ".join(f"{n}: checkpoint {a!r}, this optimizer {b!r}" for n, (a, b) in differing.items())
            fix = ", ".join(f"{n}={a!r}" for n, (a, _) in differing.items())
            raise ValueError(
                f"{type(self).__name__}: the checkpoint's schedule differs from this optimizer's ({listing}). "
                "Resuming on another schedule would restart phases whose state is gone; build the optimizer "
                f"with the checkpoint's values ({fix}), e.g. pass them explicitly to the Trainer, or start afresh."
            )
        same_rank = extra.get("world_size") == self.comm.world_size and extra.get("rank") == self.comm.rank
        if not same_rank:
            warnings.warn(
                f"{type(self).__name__}: checkpoint saved on rank {extra.get('rank')} of "
                f"{extra.get('world_size')}, loading on rank {self.comm.rank} of {self.comm.world_size}: "
                "error-feedback buffers reset to zero (momentum, variance and schedule are kept)",
                UserWarning,
                stacklevel=2,
            )
            state_dict["state"] = {
                k: {n: v for n, v in s.items() if n not in ERROR_STATE} for k, s in state_dict["state"].items()
            }
        if any("momentum_accumulator" in s for s in state_dict["state"].values()):
            raise ValueError(
                "this checkpoint comes from an earlier development version of hf_zeroone whose 0/1 Adam "
                "accumulated local updates in momentum space ('momentum_accumulator'); it cannot be resumed "
                "exactly. Resume from a checkpoint taken before var_freeze_step, or start the optimizer afresh."
            )
        # torch casts every floating-point state tensor to its parameter's dtype; the error buffers
        # stay float32 (a bf16 model keeps fp32 error feedback), so they are restored here.
        errors = {k: {n: v for n, v in s.items() if n in ERROR_STATE} for k, s in state_dict["state"].items()}
        scales = {
            k: {n: v for n, v in s.items() if n in _grad_scale.STATE_KEYS} for k, s in state_dict["state"].items()
        }
        state_dict["state"] = {
            k: {n: v for n, v in s.items() if n not in _FP32_ON_LOAD} for k, s in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            restore_errors(self.state[p], p, errors.get(saved_id, {}))
            for name, value in scales.get(saved_id, {}).items():
                self.state[p][name] = value.to(device=p.device, dtype=torch.float32, copy=True)
        for state in self.state.values():
            for name in ("momentum_mask", "pending_rows"):  # booleans, cast to the parameter's dtype by torch
                if name in state:
                    state[name] = state[name] != 0
        self.schedule = dict(extra["schedule"])
        self._flat_cache.clear()
        self._prepared_step = -1
        self.communicated_step = None
