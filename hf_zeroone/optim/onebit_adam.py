"""1-bit Adam (Tang et al., ICML 2021, https://arxiv.org/abs/2102.02888)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hf_zeroone.comm import Communicator
from hf_zeroone.optim._base import DEFAULT_CHECK_REPLICAS_EVERY, UNSET_FREEZE_STEP, CompressedAdamBase
from hf_zeroone.optim._schedule import recommended_freeze_step
from hf_zeroone.optim._step_kind import StepKind, _check_int, check_adamw_options

__all__ = ["OneBitAdam"]


class OneBitAdam(CompressedAdamBase):
    r"""1-bit Adam: exact Adam while the variance settles, then 1-bit compressed momentum.

    Warm-up, steps :math:`t < \text{freeze\_step}` (:attr:`StepKind.EXACT`): gradients are
    averaged in full precision and Adam runs unchanged,

    .. math::

        \bar g_t = \tfrac{1}{P}\textstyle\sum_i g_{i,t}, \quad
        m_t = \beta_1 m_{t-1} + (1-\beta_1)\bar g_t, \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2)\bar g_t^2 .

    Compression, :math:`t \ge \text{freeze\_step}` (:attr:`StepKind.ONEBIT_MOMENTUM`): ``v`` is
    frozen and each rank sends its local momentum through the error-compensated 1-bit allreduce
    :math:`\mathcal{C}` (:mod:`hf_zeroone.comm`),

    .. math::

        m_t = \mathcal{C}\big[\beta_1 m_{t-1} + (1-\beta_1) g_{i,t}\big], \qquad
        p_t = p_{t-1} - \text{lr}_t \Big(\frac{m_t / c_1}{\sqrt{v / c_2} + \epsilon}
              + \text{wd}\, p_{t-1}\Big),

    with bias corrections :math:`c_1 = 1-\beta_1^t`, :math:`c_2 = 1-\beta_2^{k}` (``k`` =
    ``freeze_step``, the number of variance updates) when ``bias_correction`` is on. Without
    bias correction (DeepSpeed's behaviour) a short warm-up leaves ``v`` far below its true value
    (about 3% of it after 30 steps with :math:`\beta_2 = 0.999`), and the compressed steps are
    many times too large.

    Hyper-parameter names follow DeepSpeed's ``OneBitAdam`` so configs carry over; ``lr``, ``betas``, ``eps``
    and ``weight_decay`` default to :class:`torch.optim.AdamW`'s (DeepSpeed's ``weight_decay`` was 0:
    :func:`~hf_zeroone.optim.from_deepspeed_config` keeps that for a config that leaves it out).

    Args:
        params: parameters or parameter groups. A group may carry ``exp_avg_mask``, a tensor
            broadcastable to its parameters, zero where the momentum is known to stay zero
            (DeepSpeed's option); combined with ``auto_momentum_mask``.
        lr, betas, eps, weight_decay: as :class:`torch.optim.AdamW`, defaults included (``weight_decay=1e-2``;
            pass ``weight_decay=0`` for :class:`torch.optim.Adam`'s).
        freeze_step: number of exact warm-up steps before compression starts (at least 1: the
            variance is estimated on these steps). ``None`` (default): derived from the run length
            by :meth:`set_run_length` (``T`` steps, LR warm-up ``W``:
            :func:`~hf_zeroone.optim.recommended_freeze_step` ``(T, W)``, the later of ``W`` and
            ``0.3 T``), which ``ZeroOneTrainer`` and ``prepare_zeroone(..., num_training_steps=T)``
            call; until it is called, DeepSpeed's 100000 (no compression in a shorter run), with a
            warning at the first step of a distributed run.
        bias_correction, decoupled_weight_decay, process_group, auto_momentum_mask,
        communicator, check_replicas_every, follow_gradient_scale, clip_to_variance,
        exact_step_dtype: see
            :class:`~hf_zeroone.optim.CompressedAdamBase`.
        amsgrad, maximize, foreach, capturable, differentiable, fused: ``torch.optim.AdamW``'s
            options, so that its arguments carry over: ``foreach`` and ``fused`` change nothing
            (the step is always multi-tensor); the others raise ``ValueError`` unless ``False``.

    Example::

        opt = OneBitAdam(model.parameters(), lr=1e-4)
        opt.set_run_length(len(loader) * epochs, warmup_steps=500)  # freeze_step from the run length
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()          # plain model: OneBitAdam communicates in step()
            opt.step(); opt.zero_grad()

    Wrapped in ``DistributedDataParallel``, register :func:`hf_zeroone.register_zeroone_hook` so
    communication happens during backward and DDP's own fp32 allreduce is replaced.
    """

    schedule_params = ("freeze_step",)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        freeze_step: int | None = None,
        *,
        bias_correction: bool = True,
        decoupled_weight_decay: bool = True,
        process_group: dist.ProcessGroup | None = None,
        auto_momentum_mask: bool = True,
        communicator: Communicator | None = None,
        check_replicas_every: int = DEFAULT_CHECK_REPLICAS_EVERY,
        follow_gradient_scale: bool = True,
        clip_to_variance: bool = True,
        exact_step_dtype: torch.dtype | str | None = torch.float8_e4m3fn,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError("OneBitAdam does not support amsgrad (the variance is frozen after warm-up)")
        check_adamw_options("OneBitAdam", maximize, capturable, differentiable)
        if isinstance(freeze_step, int) and not isinstance(freeze_step, bool) and freeze_step == 0:
            raise ValueError(
                "freeze_step=0 would freeze a variance that was never estimated (v = 0): nothing would "
                "train. Use at least 1 exact step, usually recommended_freeze_step(total_steps, warmup_steps)"
            )
        if freeze_step is not None:
            _check_int("freeze_step", freeze_step, 1)
        self.freeze_step = UNSET_FREEZE_STEP if freeze_step is None else freeze_step
        self._given = {"freeze_step": freeze_step}
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            decoupled_weight_decay=decoupled_weight_decay,
            process_group=process_group,
            auto_momentum_mask=auto_momentum_mask,
            communicator=communicator,
            check_replicas_every=check_replicas_every,
            follow_gradient_scale=follow_gradient_scale,
            clip_to_variance=clip_to_variance,
            exact_step_dtype=exact_step_dtype,
        )

    def _derive_schedule(self, num_training_steps: int, warmup_steps: int) -> None:
        if self._given["freeze_step"] is None:
            self.freeze_step = recommended_freeze_step(num_training_steps, warmup_steps)

    def _schedule_known(self) -> bool:
        return self._given["freeze_step"] is not None

    def next_step_kind(self) -> StepKind:
        return StepKind.EXACT if self.schedule["step"] < self.freeze_step else StepKind.ONEBIT_MOMENTUM

    def _advance_schedule(self, kind: StepKind) -> None:
        pass  # the step counter alone decides
