"""Shared machinery of the communication-compressed Adam optimizers: :class:`CompressedAdamBase`.

Every step has a :class:`~._step_kind.StepKind` fixed by the optimizer's schedule before backward
runs (the table of kinds is in :mod:`._step_kind`). What each rank sends and what the combined
result becomes is :class:`._messages.Messages` (the optimizer's ``messages``), used by two callers:
``step`` itself (:mod:`._exchange`) when nobody communicated during backward (no DDP, or DDP
without our hook), and the DDP communication hook (:mod:`hf_zeroone.ddp_hook`), which writes the
messages into DDP's gradient buckets during backward and hands the results back as ``p.grad``.
:meth:`CompressedAdamBase.step` applies the results; the per-element maths is in
:mod:`._functional`, so each formula exists once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hf_zeroone._tensors import all_finite, float32_norms, picked, zeros_like_flat
from hf_zeroone._warnings import user_stacklevel
from hf_zeroone.optim import _agreement, _local_phase, _masks
from hf_zeroone.optim import _functional as F
from hf_zeroone.optim._amp_scaler import agreed_overflow, mark_non_finite, scaler_found_inf, unscale_gradients
from hf_zeroone.optim._books import DEFAULT_CHECK_REPLICAS_EVERY, UNSET_FREEZE_STEP, OptimizerBooks
from hf_zeroone.optim._exchange import exchange
from hf_zeroone.optim._flat import FlatBuffers
from hf_zeroone.optim._functional import by_group
from hf_zeroone.optim._scalar_vectors import Noted
from hf_zeroone.optim._step_kind import StepKind

__all__ = ["DEFAULT_CHECK_REPLICAS_EVERY", "UNSET_FREEZE_STEP", "CompressedAdamBase", "FlatBuffers", "StepKind"]

#: steps skipped in a row as GradScaler overflows (non-finite combined values) before a warning says so
SKIPS_BEFORE_WARNING = 20


class CompressedAdamBase(OptimizerBooks):
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
        check_replicas_every: check that all ranks hold bit-identical parameters and the same step
            counter (one all-gather of 24 bytes, counted in ``CommStats.check_bytes``, apart from
            the training's traffic) and raise ``RuntimeError`` on every rank if they do not, so that
            replicas that drifted apart stop the run instead of training on silently:
            with the DDP hook, every this many backward passes that call it (on every rank at the
            same pass, whatever each rank's step counter says); without it, at the first
            synchronising step at least this many steps after the last check. Between two syncs
            of 0/1 Adam's local phase, where replicas differ by design, the parameters of the last
            sync are compared. Default 100 (:data:`DEFAULT_CHECK_REPLICAS_EVERY`); ``0`` turns it off.
        follow_gradient_scale: after the variance freeze, rescale the frozen ``v`` of each tensor
            (down only) by how much its gradients have shrunk relative to it (one float per
            tensor, averaged with a collective the step already makes; exact steps add one small
            allreduce; see :mod:`hf_zeroone.optim._grad_scale`). On by default: without it, a run
            whose gradients keep shrinking after the freeze (least squares) ends several times
            above AdamW's final loss (``docs/stale_variance.md``); ``False`` keeps ``v`` frozen as
            the papers and DeepSpeed do.
        clip_to_variance: after the variance freeze, clip each element of a local gradient to
            ``sqrt(v_hat) / sqrt(1 - beta2)``, the largest normalised gradient Adam itself can see
            (:func:`._functional.clip_to_variance`). On by default: a frozen ``v`` cannot absorb a
            gradient that outgrew it (a token first seen after the freeze), and such an element
            would step thousands of learning rates, and, compressed, spread that to its neighbours.
            ``False`` is the papers' and DeepSpeed's maths.
        exact_step_dtype: the precision in which exact steps (1-bit Adam's warm-up, 0/1 Adam's
            phase 1) average the gradients, most of what either optimizer sends in a run.
            ``torch.float8_e4m3fn`` (the default, or ``"float8_e4m3fn"``) sends a quarter of
            fp32's bytes: each parameter's gradient travels in blocks of 128 elements, a byte per
            element (float8 with 3 bits of mantissa) and a power-of-two scale per block (a byte),
            in the two collectives of the 1-bit allreduce, rounded on each worker and again after
            the average (:func:`hf_zeroone._two_stage.float8_allreduce`); the samples of
            ``follow_gradient_scale`` ride exact. Against bf16 its final losses stay within the
            spread between seeds (``docs/frontier.md``, ``docs/convergence.md``); it costs one more
            round per exact step (two collectives where bf16 makes one).
            ``torch.bfloat16`` (or ``"bfloat16"``)
            sends half of fp32's bytes in one collective, as DDP's ``bf16_compress_hook`` does for
            plain DDP: each gradient is rounded to 8 bits of mantissa before the average, and the
            samples with it.
            ``torch.float32`` (or ``None``): full precision (a DDP bucket's own dtype in the
            hook). It applies to fp32 gradients; fp16 and bf16 buckets go as they are, and
            compressed steps are unchanged.

    With no process group, or a world size of 1, the optimizer communicates nothing and runs Adam
    with the same schedule (so it can be used and tested in a single process).
    """

    # ------------------------------------------------------------------ preparation
    def check_ranks_agree(self) -> None:
        """Once after a build or a load, on several ranks: ``ValueError`` on every rank if they built this optimizer
        differently (:mod:`._agreement`). Called before the first collective of a step (by :meth:`prepare_step`
        and the DDP hook); collective, so every rank must reach it.
        """
        if not self._ranks_agree and self.comm.is_distributed:
            _agreement.check_ranks_agree(self)  # a mismatch raises on every rank: no hang, no abort
            self._ranks_agree = True

    def prepare_step(self) -> StepKind:
        """Make the state ready for the coming step and return its kind. Idempotent per step.

        Called by :meth:`step` and by the DDP hook before it computes messages.
        """
        self.check_ranks_agree()
        kind = self.next_step_kind()
        if self._prepared_step == self.schedule["step"]:
            return kind
        if self.schedule["step"] == 0:
            self._warn_unset_schedule()
        fresh = [(group, p) for group, p in self.trainable_params() if "exp_avg" not in self.state[p]]
        for key in ("exp_avg", "exp_avg_sq"):  # each a flat tensor's pieces: one operation can cover them all
            for (_, p), zeros in zip(fresh, zeros_like_flat([p for _, p in fresh])):
                self.state[p][key] = zeros
        if (kind.compressed or kind is StepKind.LOCAL) and not self.schedule["masks_ready"]:
            _masks.build_masks(self.trainable_params(), lambda p: self.state[p], self.auto_momentum_mask)
            self.schedule["masks_ready"] = True
            self.flat_cache.clear()
        elif fresh and self.schedule["masks_ready"]:  # trainable since the masks were built (requires_grad
            # turned on): masked as they would have been then (v = 0), released by their first gradient
            _masks.build_masks(fresh, lambda p: self.state[p], self.auto_momentum_mask)
            self.flat_cache.clear()
        if kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC):
            if not self.schedule.get("local_phase_started", True):
                _local_phase.start_local_phase([p for _, p in self.trainable_params()], lambda p: self.state[p])
                self.schedule["local_phase_started"] = True
            else:  # a parameter that became trainable since (requires_grad turned on): it joins from here
                joined = [p for _, p in self.trainable_params() if "sync_param" not in self.state[p]]
                if joined:
                    _local_phase.start_local_phase(joined, lambda p: self.state[p])
        elif "local_phase_started" in self.schedule:
            # Back before the local phase (e.g. var_freeze_step raised): its state is stale, and
            # entering the local phase again must start from the parameters of that moment.
            self.schedule["local_phase_started"] = False
        self._prepared_step = self.schedule["step"]
        self._stats_at_step_start = self.comm.stats.copy()
        return kind

    # ------------------------------------------------------------------ the step
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether a GradScaler should call :meth:`step` even on an overflow (its protocol; :mod:`._amp_scaler`).

        Only where this step communicates in ``step()`` on several ranks (no hf_zeroone DDP hook ran):
        a rank that skipped alone would leave the others' exchange unanswered, or its step counter
        behind theirs. Elsewhere the scaler skips ``step()`` itself, as for AdamW.
        """
        return self.comm.is_distributed and self.communicated_step != self.schedule["step"]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step (communicating first unless a DDP hook already did)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kind = self.prepare_step()
        if scaler_found_inf(self) is not None:  # a GradScaler's protocol: the gradients come scaled
            unscale_gradients((p for g in self.param_groups for p in g["params"]), getattr(self, "grad_scale", None))
        self.grad_generation += 1
        self._step_denominators = {}  # a frozen variance's denominators, computed once per step
        try:
            return self._step(kind, loss)
        finally:
            self._step_denominators = None
            self.variance_views.release()
            self.variance_views.settle()

    def _step(self, kind: StepKind, loss: Any) -> Any:  # noqa: ANN401
        hook_done = self.communicated_step == self.schedule["step"]
        pending = Noted()  # divisors the update applies (1-bit Adam's norm proxies)
        norms = None  # of the values handed on, where the norm proxies took them
        found_inf = scaler_found_inf(self)
        if found_inf is not None:  # a GradScaler's protocol (._amp_scaler): every rank skips if one overflowed
            exchanges = kind.communicates_in_backward and not hook_done
            if exchanges and bool(found_inf.item() > 0):
                mark_non_finite(p for _, p in self.trainable_params())  # the exchange carries it to every rank
            elif not exchanges:  # a local step or sync: ranks that step alone agree first
                agree = self.comm.is_distributed and not hook_done
                if agreed_overflow(found_inf, self.comm.allreduce_mean) if agree else bool(found_inf.item() > 0):
                    self.communicated_step = None
                    return loss  # as the scaler skips step(): no state changes
        if kind.communicates_in_backward and not hook_done:
            if self.comm.is_distributed and not (self._warned_step_path or self.hook_defers_some_steps):
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
            local = kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC)
            if local and not hook_done and self.comm.is_distributed:
                # A parameter with no gradient on this rank (a branch this rank's batch did not take)
                # steps on a zero one, as exchange() hands it on in the other kinds (and as DDP hands
                # on one that another rank used): every rank books the same local steps, and the sync
                # lands on the same parameters. Without DDP no rank knows whether another used it, so
                # one that no rank used steps on zeros too (its momentum and weight decay move it, as
                # on exact steps), where the hook, told by DDP, leaves it alone.
                updates = [
                    (g, p, torch.zeros_like(p) if p.grad is None else p.grad) for g, p in self.trainable_params()
                ]
            else:
                updates = [(g, p, p.grad) for g, p in self.trainable_params() if p.grad is not None]
            if local and not hook_done:  # as the hook hands them on: both paths agree bit for bit
                values = self.messages.hand_on_local_gradients(
                    [p for _, p, _ in updates], [v for _, _, v in updates], in_place=False
                )
                updates = [(g, p, v) for (g, p, _), v in zip(updates, values)]
            if local or (kind is StepKind.ONEBIT_MOMENTUM and hook_done):
                values = [v for _, _, v in updates]
                norms = None if local else float32_norms(values)  # implied gradients: every norm is measured
                positions, divisors = self.messages.norm_proxy_divisors([p for _, p, _ in updates], values, norms)
                # Float32 implied gradients are divided inside the update: no divided copy of each. The
                # finiteness check below then reads them (their norms) undivided; a factor only shrinks a
                # norm that float32 holds (an infinite norm gets factor 1), so their quotients are finite too.
                if not local and divisors is not None:
                    inside = [
                        j for j, i in enumerate(positions) if values[i].dtype == updates[i][1].dtype == torch.float32
                    ]
                    if inside:
                        pending.note([updates[positions[j]][1] for j in inside], picked(divisors, inside))
                        now = sorted(set(range(len(positions))) - set(inside))
                        positions, divisors = [positions[j] for j in now], picked(divisors, now) if now else None
                values = F.divided(values, positions, divisors)
                updates = [(g, p, v) for (g, p, _), v in zip(updates, values)]
        self.messages.contain_spikes()
        for _, _, value in updates:
            if value.is_sparse:
                raise ValueError(f"{type(self).__name__} does not support sparse gradients")
        if not all_finite((v for _, _, v in updates), norms):
            if kind.communicates_in_backward:
                # Every rank holds the same combined values, so every rank skips together.
                if found_inf is not None:  # a GradScaler's overflow on some rank: its skip, no warning
                    self._scaler_skips_in_a_row += 1
                    if self._scaler_skips_in_a_row % SKIPS_BEFORE_WARNING == 0:  # not a scaler finding its scale
                        warnings.warn(
                            f"{type(self).__name__}: non-finite values after communication on "
                            f"{self._scaler_skips_in_a_row} steps in a row (step {self.schedule['step']}, "
                            f"{kind.value}), each skipped on all ranks as a GradScaler overflow; if no rank's "
                            "loss scale keeps falling, the non-finite values come from elsewhere (the "
                            "model's parameters or inputs)",
                            RuntimeWarning,
                            stacklevel=user_stacklevel(),
                        )
                    self.communicated_step = None
                    return loss
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
                "Lower the learning rate, clip gradients, or use a GradScaler and pass it to the hook "
                "(register_zeroone_hook(..., grad_scaler=scaler)): the ranks then agree on overflow and skip together."
            )
        self._scaler_skips_in_a_row = 0
        self._apply(kind, updates, pending)
        # after the update: this step's denominators used the gradient scale as it stood before it
        self.gradient_scale.fold(
            kind,
            by_group(updates),
            lambda p: self.state[p],
            self.schedule,
            self.follow_gradient_scale,
            lambda group, params, values: self.messages.scale_samples(params, values),
            gap=self._variance_gap() if kind is StepKind.EXACT else 1,
        )
        if kind is StepKind.ONEBIT_SYNC:
            _local_phase.sync(self, exchange(self, kind))
        if kind is StepKind.EXACT:
            self.schedule["variance_steps"] = self.variance_steps() + self._variance_gap()
            self.schedule["variance_updates"] += 1
        if kind.communicates:
            self._release_masked_rows(kind)
        self.last_step_stats = self.comm.stats - self._stats_at_step_start
        self.last_step_kind = kind
        self._advance_schedule(kind)
        self.schedule["step"] += 1
        self.communicated_step = None
        self._steps_since_check += 1
        if self.check_replicas_every and kind.communicates and not self.hook_checks_replicas:
            if self._steps_since_check >= self.check_replicas_every:
                self._steps_since_check = 0
                self.check_replicas(f"after step {self.schedule['step']}")
        return loss

    def _release_masked_rows(self, kind: StepKind) -> None:
        """Unmask the rows that a gradient reached on any rank (see :mod:`._masks`), after a step that communicated."""
        if not (self.schedule["masks_ready"] and self.auto_momentum_mask):
            return

        def agree(flags: Tensor) -> Tensor:  # where no lane carried the flags
            return self.comm.allreduce_mean(flags) if self.comm.is_distributed else flags

        def around_release(group: dict[str, Any], p: Tensor, release: Callable[[], None]) -> None:
            # releasing rows writes into v: the error buffers' units change with it
            held = self.messages.errors_to_gradient_units(group, [p])
            release()
            self.messages.errors_to_update_units(group, held, self._variance_correction(group))

        changed = _masks.release_masked_rows(
            self.trainable_params(), lambda p: self.state[p], kind is StepKind.EXACT, agree, around_release
        )
        self.flat_cache.refresh_masks(changed)

    def _apply(
        self,
        kind: StepKind,
        updates: list[tuple[dict[str, Any], Tensor, Tensor]],
        divisors: Noted,
    ) -> None:
        """Update every parameter and its state from its combined result (or its local gradient).

        ``divisors``: per parameter, a float32 number its (float32) value is divided by first.
        """
        local = kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC)
        for group, params, values in by_group(updates):
            lr, wd = group["lr"], group["weight_decay"]
            c1, c2 = self._coefficients(group, kind)
            decay = 1.0 - lr * wd if group["decoupled_weight_decay"] else 1.0
            grads = F.as_dtypes(values, params)
            dens = None
            if local:  # the local gradient meets the frozen variance here (the 1-bit kinds clip in their messages)
                dens = self._denominators(group, params, kind, c2)
                if self.clip_to_variance:
                    grads = F.clip_to_variance(grads, dens, group["betas"][1])
            # An implied gradient (ONEBIT_MOMENTUM) already carries the L2 term of the message.
            if kind is not StepKind.ONEBIT_MOMENTUM and wd and not group["decoupled_weight_decay"]:
                grads = F.l2_gradients(grads, params, wd)
            states = [self.state[p] for p in params]
            if local:
                grads = _masks.mask_local_gradients(states, grads, values)
            # v changes under the error buffers of earlier 1-bit steps: in gradient units meanwhile
            in_gradient_units = self.messages.errors_to_gradient_units(group, params) if kind is StepKind.EXACT else []
            dens = F.adam_update(
                params,
                grads,
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                lr=lr,
                beta1=group["betas"][0],
                beta2=group["betas"][1] ** (self._variance_gap() if kind is StepKind.EXACT else 1),
                c1=c1,
                decay=decay,
                update_variance=kind is StepKind.EXACT,
                divisors=divisors.gather(params) if divisors else None,
                make_denominators=(lambda dens=dens: dens)
                if dens is not None
                else (lambda group=group, params=params, c2=c2: self._denominators(group, params, kind, c2)),
            )
            if local:
                _local_phase.note_local_step(states, dens, lr, c1, decay)
            if in_gradient_units:  # c2: the correction of the updated variance
                self.messages.errors_to_update_units(group, in_gradient_units, c2)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; also forgets a hook's results never stepped on.

        After a step that was not taken (a GradScaler skip), the next gradients must not be taken
        for combined results unless the hook runs again.
        """
        self.communicated_step = None
        self.grad_generation += 1
        super().zero_grad(set_to_none=set_to_none)
