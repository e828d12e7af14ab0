"""0/1 Adam (Lu et al., ICLR 2023, https://arxiv.org/abs/2202.06009)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hf_zeroone.comm import Communicator
from hf_zeroone.optim import _local_phase
from hf_zeroone.optim._base import DEFAULT_CHECK_REPLICAS_EVERY, UNSET_FREEZE_STEP, CompressedAdamBase
from hf_zeroone.optim._exchange import exchange
from hf_zeroone.optim._schedule import recommended_freeze_step, recommended_local_steps
from hf_zeroone.optim._step_kind import StepKind, _check_int, check_adamw_options

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(CompressedAdamBase):
    r"""0/1 Adam: sparse variance updates, 1-bit gradients, then local steps with 1-bit syncs.

    **Phase 1**, steps :math:`t < \text{var\_freeze\_step}`. On the variance steps
    :math:`t \in T_v` (:attr:`StepKind.EXACT`) gradients are averaged in full precision and both
    ``m`` and ``v`` are updated. On the others (:attr:`StepKind.ONEBIT_GRADIENT`) gradients go
    through the error-compensated 1-bit allreduce :math:`\mathcal{C}` and only ``m`` moves:

    .. math::

        \hat g_t = \mathcal{C}[g_{i,t}], \quad m_t = \beta_1 m_{t-1} + (1-\beta_1)\hat g_t, \quad
        p_t = p_{t-1} - \text{lr}_t \frac{m_t/c_1}{\sqrt{v/c_2}+\epsilon}.

    :math:`T_v`: the gap between variance steps starts at 1 and doubles after every
    ``var_update_scaler`` variance updates. The first ``exact_warmup_steps`` steps are all
    variance steps, before :math:`T_v` starts; by default that is all of phase 1, and the 1-bit
    gradient steps are the paper's schedule, which ``exact_warmup_steps=0`` restores. A variance step after a gap of
    :math:`k` steps stands for them: :math:`v \leftarrow \beta_2^k v + (1-\beta_2^k) \hat g^2`,
    with bias correction :math:`c_2 = 1 - \beta_2^{t_v}`, :math:`t_v` the steps covered
    (:meth:`~hf_zeroone.optim.CompressedAdamBase.variance_steps`).

    **Phase 2**, :math:`t \ge \text{var\_freeze\_step}`: ``v`` is frozen and ranks take *local*
    steps (:attr:`StepKind.LOCAL`, nothing sent). With :math:`d = \sqrt{v/c_2}+\epsilon` (fixed
    in this phase):
    :math:`m \leftarrow \beta_1 m + (1-\beta_1) g_{i,t}`,
    :math:`p \leftarrow (1 - \text{lr}_t\,\text{wd})\, p - \text{lr}_t \frac{m/c_1}{d}`.
    On the steps of :math:`T_u` (:attr:`StepKind.ONEBIT_SYNC`) ranks average the displacement of
    their local steps since the last sync, :math:`u_i = \delta\, p_s - p_i`, with
    :math:`\mathcal{C}`; every replica goes back to the parameters of the last sync :math:`p_s` and
    applies the average,

    .. math::

        \bar u = \mathcal{C}[u_i], \quad p = \delta\, p_s - \bar u, \quad
        m = c_1 \frac{d \, \bar u}{\sum \text{lr}},

    where :math:`\delta` is the product of the decoupled weight-decay factors
    :math:`1 - \text{lr}_t\,\text{wd}` over the interval. :math:`p_s` is stored (one copy of the
    parameters) so every replica holds bit-identical parameters after each sync; ``u`` is derived
    from it and ``p`` when the sync comes, not held (a bf16 or fp16 parameter accumulates
    :math:`\sum \text{lr}_t \frac{m/c_1}{d}` in a buffer instead: rounding ``p`` to its precision
    at every local step would lose what the buffer keeps). Without compression the sync leaves
    ``p`` where the local steps put it.
    :math:`T_u`: the gap between syncs starts at 1 and doubles every ``local_step_scaler`` steps,
    up to ``local_step_clipper``. The error buffers are reset when phase 2 starts (they held
    gradient errors, and now hold errors of ``u``), as DeepSpeed does.

    **Two deliberate differences from the paper and DeepSpeed.** They update ``v`` on a
    variance step as if no step had passed since the last one, so the dense early samples outweigh
    the sparse later ones (above: each stands for its gap). And they accumulate and compress ``u``
    in momentum space (:math:`\sum \text{lr}_t m`, divided by :math:`d` after the sync). Since
    ``v`` is frozen the two are the same without compression; with it, the 1-bit operator gives
    every element of a segment the same magnitude, and in momentum space that magnitude is then
    divided by each element's :math:`d`: elements with a small variance (rare tokens, for
    example) get kicks many times their own update, which grow with the sync gap: momentum-space
    syncs can diverge at sync gaps where parameter-space syncs stay at AdamW's loss. The bytes sent
    are the same. The message is ``u`` per unit of the interval's summed learning rate
    (:func:`~hf_zeroone.optim._local_phase.per_lr_units`), so error feedback pays an error back at
    the learning rate of the sync that pays it.

    Hyper-parameter names follow DeepSpeed's ``ZeroOneAdam`` so configs carry over; ``lr``, ``betas``, ``eps``
    and ``weight_decay`` default to :class:`torch.optim.AdamW`'s (DeepSpeed's ``weight_decay`` was 0:
    :func:`~hf_zeroone.optim.from_deepspeed_config` keeps that for a config that leaves it out).

    Args:
        params: parameters or parameter groups (a group may carry ``exp_avg_mask``, see
            :class:`OneBitAdam`).
        lr, betas, eps, weight_decay: as :class:`torch.optim.AdamW`, defaults included (``weight_decay=1e-2``;
            pass ``weight_decay=0`` for :class:`torch.optim.Adam`'s).
        var_freeze_step: first step of phase 2 (at least 1; for a run of ``T`` steps with an LR
            warm-up of ``W``: :func:`~hf_zeroone.optim.recommended_freeze_step` ``(T, 2 * W)``, the
            later of ``2 W`` and ``0.3 T``).
        var_update_scaler: variance updates between doublings of the variance-step gap
            (:math:`\kappa` in the paper).
        local_step_scaler: local-phase steps between doublings of the sync gap. ``None`` (default):
            ``max(1, var_freeze_step // 4)``, so the gap reaches ``local_step_clipper`` about
            ``var_freeze_step`` steps into the local phase. (DeepSpeed's 32678 means no local
            steps at all in a run shorter than about 32k steps.) For a run of known length,
            :func:`~hf_zeroone.optim.recommended_local_steps` gives this and ``local_step_clipper``.
        local_step_clipper: largest sync gap (:math:`H` in the paper). In a short run keep it to a
            sixty-fourth of the local phase or less (what ``recommended_local_steps`` does): in a
            short fine-tuning run the paper's 16 costs 0/1 Adam accuracy.
        exact_warmup_steps: number of first steps that are all exact variance steps. ``None``
            (the default): all of phase 1, every step before ``var_freeze_step``, so ``v`` is
            estimated as Adam estimates it and 0/1 Adam's savings come from its local phase. With
            the exact steps in float8 or bf16 (``exact_step_dtype``) that sends less than the
            paper's schedule with its steps in fp32, and lands closer to AdamW
            (``docs/convergence.md``). ``0`` is the paper's and DeepSpeed's
            schedule (1-bit gradients from the second variance gap); a smaller number keeps the
            paper's schedule after that many exact steps.
        bias_correction, decoupled_weight_decay, process_group, auto_momentum_mask,
        communicator, check_replicas_every, follow_gradient_scale, clip_to_variance,
        exact_step_dtype: see
            :class:`~hf_zeroone.optim.CompressedAdamBase`.
        amsgrad, maximize, foreach, capturable, differentiable, fused: ``torch.optim.AdamW``'s
            options, so that its arguments carry over: ``foreach`` and ``fused`` change nothing
            (the step is always multi-tensor); the others raise ``ValueError`` unless ``False``.
    """

    schedule_params = (
        "var_freeze_step",
        "var_update_scaler",
        "local_step_scaler",
        "local_step_clipper",
        "exact_warmup_steps",
    )

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        var_freeze_step: int | None = None,
        var_update_scaler: int = 16,
        local_step_scaler: int | None = None,
        local_step_clipper: int | None = None,
        *,
        exact_warmup_steps: int | None = None,
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
            raise ValueError("ZeroOneAdam does not support amsgrad (the variance is updated sparsely)")
        check_adamw_options("ZeroOneAdam", maximize, capturable, differentiable)
        if isinstance(var_freeze_step, int) and not isinstance(var_freeze_step, bool) and var_freeze_step == 0:
            raise ValueError(
                "var_freeze_step=0 would freeze a variance that was never estimated (v = 0): nothing would "
                "train. Use at least 1, usually recommended_freeze_step(total_steps, 2 * warmup_steps)"
            )
        for name, value, minimum in (
            ("var_freeze_step", var_freeze_step, 1),
            ("local_step_scaler", local_step_scaler, 1),
            ("local_step_clipper", local_step_clipper, 1),
            ("exact_warmup_steps", exact_warmup_steps, 0),
        ):
            if value is not None:
                _check_int(name, value, minimum)
        _check_int("var_update_scaler", var_update_scaler, 1)
        self._given = {
            "exact_warmup_steps": exact_warmup_steps,
            "var_freeze_step": var_freeze_step,
            "local_step_scaler": local_step_scaler,
            "local_step_clipper": local_step_clipper,
        }
        self.var_freeze_step = UNSET_FREEZE_STEP if var_freeze_step is None else var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_clipper = 16 if local_step_clipper is None else local_step_clipper
        self.local_step_scaler = max(1, self.var_freeze_step // 4) if local_step_scaler is None else local_step_scaler
        self.exact_warmup_steps = exact_warmup_steps
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
        given = self._given
        if given["var_freeze_step"] is None:
            self.var_freeze_step = recommended_freeze_step(num_training_steps, 2 * warmup_steps)
        if given["exact_warmup_steps"] is None:
            self.exact_warmup_steps = self.var_freeze_step  # all of phase 1, named
        local = recommended_local_steps(num_training_steps, self.var_freeze_step, given["local_step_clipper"])
        self.local_step_clipper = local["local_step_clipper"]
        if given["local_step_scaler"] is None:
            self.local_step_scaler = local["local_step_scaler"]

    def _schedule_known(self) -> bool:
        return self._given["var_freeze_step"] is not None

    @property
    def in_sync(self) -> bool:
        """``False`` between two syncs of the local phase: every replica has taken local steps of its own."""
        return not (self.schedule.get("local_phase_started") and self.schedule["steps_since_sync"] > 0)

    @torch.no_grad()
    def synchronize(self) -> bool:
        """Bring every replica to the same parameters now: the 1-bit sync of the local phase, out of schedule.

        In the local phase, replicas differ between syncs; call this on every rank (it is a
        collective) between two steps where a run needs one model, e.g. after the last step, before
        an evaluation or a checkpoint (``ZeroOneTrainer`` and ``prepare_zeroone`` do it for their
        checkpoints and at the end of training). It averages the displacements since the last sync
        (1-bit, with error feedback, as a scheduled sync does), after which parameters and momentum
        are bit-identical on every rank, and the next sync interval starts here. Returns whether it
        synced (``False`` outside the local phase or right after a sync: nothing to do).
        """
        if self.in_sync or not self.comm.is_distributed:
            return False
        stats = self.comm.stats.copy()
        _local_phase.sync(self, exchange(self, StepKind.ONEBIT_SYNC), step=self.schedule["step"])
        self._release_masked_rows(StepKind.ONEBIT_SYNC)
        self.schedule["steps_since_sync"] = 0
        self.last_step_stats = self.last_step_stats + (self.comm.stats - stats)
        return True

    def _initial_schedule(self) -> dict[str, Any]:
        return {
            "var_interval": 1,
            "var_updates_at_interval": 0,
            "steps_since_var_update": 0,
            "local_step_interval": 1,
            "local_steps_at_interval": 0,
            "steps_since_sync": 0,
            "local_phase_started": False,
        }

    def _exact_steps(self) -> int:
        """How many first steps are all exact: ``exact_warmup_steps``, or all of phase 1 when it is ``None``."""
        return self.var_freeze_step if self.exact_warmup_steps is None else self.exact_warmup_steps

    def _first_compressed_step(self) -> int:
        """Phase 1 sends 1-bit gradients from the end of the exact warm-up, the local phase starts at the freeze."""
        return min(self.var_freeze_step, self._exact_steps())

    def _in_exact_warmup(self) -> bool:
        """Whether the coming step belongs to the exact warm-up (see ``exact_warmup_steps``)."""
        return self.schedule["step"] < self._exact_steps()

    def _schedule_hyperparameters(self) -> dict[str, Any]:
        """As :attr:`schedule_params`, with ``exact_warmup_steps`` as it acts (``None`` is ``var_freeze_step``)."""
        return {**super()._schedule_hyperparameters(), "exact_warmup_steps": self._exact_steps()}

    #: schedule entries of the retired "exact while the learning rate rises" rule, which older checkpoints hold
    _retired_schedule_keys = ("lr_rising", "last_lrs")

    def _saved_schedule_hyperparameters(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A saved ``exact_warmup_steps=None`` (an older checkpoint's) meant "while the learning rate rises".

        Checkpoints hold the number of exact steps as it acts, so that ``None`` cannot be compared
        with it: the user says how to resume it, by giving ``exact_warmup_steps``, or the checkpoint
        is refused.
        """
        if "exact_warmup_steps" not in saved or saved["exact_warmup_steps"] is not None:
            return saved
        if self._given.get("exact_warmup_steps") is None:
            raise ValueError(
                f"{type(self).__name__}: this checkpoint comes from an earlier version of hf_zeroone, whose "
                "exact_warmup_steps=None meant 'exact while the learning rate rises'; it now means all of phase 1. "
                "Build the optimizer with exact_warmup_steps set to the number of LR warm-up steps of that run to "
                "resume it as it was, or start afresh."
            )
        return {k: v for k, v in saved.items() if k != "exact_warmup_steps"}  # the user chose how to resume it

    def _variance_gap(self) -> int:
        """The steps since the last variance update, this one included (see ``variance_steps``)."""
        return self.schedule["steps_since_var_update"] + 1

    def next_step_kind(self) -> StepKind:
        s = self.schedule
        if s["step"] < self.var_freeze_step:
            if self._in_exact_warmup() or s["steps_since_var_update"] + 1 >= s["var_interval"]:
                return StepKind.EXACT
            return StepKind.ONEBIT_GRADIENT
        if s["steps_since_sync"] + 1 >= s["local_step_interval"]:
            return StepKind.ONEBIT_SYNC
        return StepKind.LOCAL

    def _advance_schedule(self, kind: StepKind) -> None:
        s = self.schedule
        in_warmup = self._in_exact_warmup()
        if kind is StepKind.EXACT:
            s["steps_since_var_update"] = 0
            if not in_warmup:
                s["var_updates_at_interval"] += 1
                if s["var_updates_at_interval"] == self.var_update_scaler:
                    s["var_updates_at_interval"] = 0
                    s["var_interval"] *= 2
        elif kind is StepKind.ONEBIT_GRADIENT:
            s["steps_since_var_update"] += 1
        else:  # LOCAL or ONEBIT_SYNC
            s["steps_since_sync"] = 0 if kind is StepKind.ONEBIT_SYNC else s["steps_since_sync"] + 1
            s["local_steps_at_interval"] += 1
            if s["local_steps_at_interval"] == self.local_step_scaler:
                s["local_steps_at_interval"] = 0
                s["local_step_interval"] = min(self.local_step_clipper, 2 * s["local_step_interval"])

    def schedule_summary(self) -> dict[str, Any]:
        """Phase, variance-step gap and local-step gap, for logging."""
        s = self.schedule
        phase = "variance" if s["step"] < self.var_freeze_step else "local"
        return {
            "phase": phase,
            "var_interval": s["var_interval"],
            "local_step_interval": s["local_step_interval"],
        }
