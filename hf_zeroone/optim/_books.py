"""The books of a communication-compressed Adam optimizer: groups, state, schedule counters, checkpoints.

:class:`OptimizerBooks` holds what a :class:`~hf_zeroone.optim.CompressedAdamBase` keeps between
steps and the settings that shape its schedule (the run length, :meth:`OptimizerBooks.set_run_length`),
with their checks; :class:`~hf_zeroone.optim.CompressedAdamBase` adds the step itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from hf_zeroone._tensors import zeros_like_flat
from hf_zeroone._warnings import user_stacklevel
from hf_zeroone.comm import CommStats, Communicator
from hf_zeroone.optim import _checkpoint, _memory
from hf_zeroone.optim._flat import FlatBufferCache
from hf_zeroone.optim._functional import by_group
from hf_zeroone.optim._grad_scale import GradientScale
from hf_zeroone.optim._messages import Messages
from hf_zeroone.optim._step_kind import (
    StepKind,
    _check_int,
    check_adam_arguments,
    check_exact_step_dtype,
    check_param_group,
)
from hf_zeroone.optim._variance_books import VarianceBooks
from hf_zeroone.optim._variance_views import VarianceViews

__all__ = ["DEFAULT_CHECK_REPLICAS_EVERY", "UNSET_FREEZE_STEP", "OptimizerBooks"]

#: the variance freeze of an optimizer whose run length was never given: DeepSpeed's default,
#: which means no compression in a run shorter than that (see OptimizerBooks.set_run_length)
UNSET_FREEZE_STEP = 100000
#: ``check_replicas_every``'s default: the replicas' bits and step counters are compared every this many
#: backward passes through the DDP hook (without it, at the first synchronising step this many steps after
#: the last check), so replicas that drift apart stop the run; a checksum pass over the parameters and a
#: 24-byte all-gather each time
DEFAULT_CHECK_REPLICAS_EVERY = 100


class OptimizerBooks(VarianceBooks, Optimizer):
    """Parameter groups, per-parameter state, schedule counters, communicator and checkpoints (see the module)."""

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
        check_replicas_every: int = DEFAULT_CHECK_REPLICAS_EVERY,
        follow_gradient_scale: bool = True,
        clip_to_variance: bool = True,
        exact_step_dtype: torch.dtype | str | None = torch.float8_e4m3fn,
    ) -> None:
        _check_int("check_replicas_every", check_replicas_every, 0)
        #: what exact steps send fp32 gradients in (None: as they are); see :meth:`exact_message_dtype`
        self.exact_step_dtype = check_exact_step_dtype(exact_step_dtype)
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
        self.clip_to_variance = bool(clip_to_variance)
        self.comm = communicator if communicator is not None else Communicator(process_group)
        self.schedule: dict[str, Any] = {
            "step": 0,
            "variance_updates": 0,
            # the steps the variance stands for: each update counts for the steps since the one before
            # (0/1 Adam's sparse updates); its bias correction is 1 - beta2 ** variance_steps
            "variance_steps": 0,
            "masks_ready": False,
            "scale_samples": 0,  # samples folded into the gradient scale since the last variance update (._grad_scale)
            # the steps the local gradients' noise excess stands for (._grad_scale), counted like variance_steps
            "noise_samples": 0,
        }
        self.schedule.update(self._initial_schedule())
        #: the flat error buffers, one per list of parameters communicated together (see ._flat)
        self.flat_cache = FlatBufferCache(
            lambda p: self.state[p], self.comm.world_size, self.comm.rank, type(self).__name__
        )
        #: this step's samples of follow_gradient_scale (see ._grad_scale)
        self.gradient_scale = GradientScale()
        #: the denominators and sample statistics of each v, computed once per version (see ._variance_views)
        self.variance_views = VarianceViews()
        #: a DDP hook's denominators of this step, for its update (see ._variance_views)
        self._prepared_step = -1
        #: whether the ranks' settings were compared (:mod:`._agreement`), at the first step after a build or a load
        self._ranks_agree = False
        self._group_of: dict[int, dict[str, Any]] | None = None
        #: set by a DDP hook: the step whose results are already in ``p.grad``
        self.communicated_step: int | None = None
        #: counts the calls of step() and zero_grad(): a DDP hook called twice for one value sees
        #: gradients accumulated over backward passes (gradient accumulation without no_sync())
        self.grad_generation = 0
        #: set by a DDP hook that leaves some steps' combining to step() (accumulation without
        #: no_sync(): see hf_zeroone.ddp_hook); step() then communicates without warning
        self.hook_defers_some_steps = False
        self._stats_at_step_start = CommStats()
        #: bytes and collectives of the last completed step, and its kind
        self.last_step_stats = CommStats()
        self.last_step_kind: StepKind | None = None
        self._warned_step_path = False
        #: steps skipped in a row on non-finite combined values under a GradScaler's protocol (._amp_scaler)
        self._scaler_skips_in_a_row = 0
        self.check_replicas_every = check_replicas_every
        #: steps taken since the last replica check (or the first step)
        self._steps_since_check = 0
        #: set by ``register_zeroone_hook``: the hook checks the replicas at its backward passes, not step()
        #: (the passes line up across ranks whatever their step counters say; see check_replicas_every)
        self.hook_checks_replicas = False
        #: what each rank sends and what the combined results become (hook and step() alike)
        self.messages = Messages(self)
        for group in self.param_groups:
            check_param_group(group, type(self).__name__)

    # ------------------------------------------------------------------ subclass interface
    def _initial_schedule(self) -> dict[str, Any]:
        return {}

    def next_step_kind(self) -> StepKind:
        """The kind of the coming step (a pure function of the schedule state)."""
        raise NotImplementedError

    def _advance_schedule(self, kind: StepKind) -> None:
        raise NotImplementedError

    def _derive_schedule(self, num_training_steps: int, warmup_steps: int) -> None:
        raise NotImplementedError

    def _schedule_known(self) -> bool:
        """Whether the variance freeze was given (or derived by :meth:`set_run_length`)."""
        raise NotImplementedError

    def _schedule_hyperparameters(self) -> dict[str, Any]:
        """The values of :attr:`schedule_params` as the schedule acts on them (what a checkpoint must match)."""
        return {name: getattr(self, name) for name in self.schedule_params}

    #: retired schedule entries that older checkpoints may hold, dropped on load
    _retired_schedule_keys: tuple[str, ...] = ()

    def _saved_schedule_hyperparameters(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's :meth:`_schedule_hyperparameters`, read with their current meaning."""
        return saved

    # ------------------------------------------------------------------ run length and replicas
    def set_run_length(self, num_training_steps: int, warmup_steps: int = 0) -> None:
        """Derive the schedule settings left unset from the run's length, before the first step.

        ``num_training_steps``: optimizer steps of the run (a script's ``max_train_steps``: with
        gradient accumulation, the steps of ``step()``, not the micro-batches); ``warmup_steps``:
        the LR warm-up in the same steps (what the script passes for it, *before* multiplying it by
        the number of processes for an Accelerate scheduler). Settings given to the constructor are
        kept; the others follow :func:`~hf_zeroone.optim.recommended_freeze_step` and
        :func:`~hf_zeroone.optim.recommended_local_steps`, as ``ZeroOneTrainer`` derives them.
        """
        _check_int("num_training_steps", num_training_steps, 1)
        _check_int("warmup_steps", warmup_steps, 0)
        if self.schedule["step"] > 0:
            raise ValueError(
                f"{type(self).__name__}.set_run_length must be called before the first step (this optimizer "
                f"has taken {self.schedule['step']}): the schedule decides what the first steps communicate"
            )
        self._derive_schedule(num_training_steps, warmup_steps)
        self._run_length = (num_training_steps, warmup_steps)
        first = self._first_compressed_step()
        if first >= num_training_steps:
            settings = ", ".join(f"{k}={v}" for k, v in self._schedule_hyperparameters().items())
            warnings.warn(
                f"{type(self).__name__}: the first compressed step would be step {first}, not before the end of the "
                f"run ({num_training_steps} steps{f', warm-up {warmup_steps}' if warmup_steps else ''}; {settings}): "
                "every step is exact, nothing is compressed. Give a warm-up shorter than the run, or a smaller "
                "freeze step.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def _first_compressed_step(self) -> int:
        """The first step the schedule compresses (or, later, takes locally): the variance freeze by default."""
        return getattr(self, self.schedule_params[0])

    @property
    def in_sync(self) -> bool:
        """Whether every replica holds the same parameters now (always, but between 0/1 Adam's syncs)."""
        return True

    def check_replicas(self, when: str) -> None:
        """Raise ``RuntimeError`` on every rank if the replicas differ in any bit (a collective: call it on every rank).

        Compares the trainable parameters, or between two syncs of 0/1 Adam's local phase, where
        they differ by design, the parameters of the last sync (``check_replicas_every``); a
        parameter that has not joined the local phase yet (trainable since its last step) has
        taken no local step, so it is compared itself. The ranks' step counters are compared too.
        """
        params, step = [p for _, p in self.trainable_params()], self.schedule["step"]
        if self.in_sync:
            self.comm.assert_identical(params, f"parameters {when}", step=step)
        else:
            synced = [self.state[p].get("sync_param", p) for p in params]
            self.comm.assert_identical(synced, f"last synced parameters {when}", step=step)

    def synchronize(self) -> bool:
        """Make every replica hold the same parameters; returns whether anything was sent.

        1-bit Adam's replicas are identical after every step, so there is nothing to do; see
        :meth:`ZeroOneAdam.synchronize <hf_zeroone.optim.ZeroOneAdam.synchronize>` for the local phase.
        """
        return False

    def _warn_unset_schedule(self) -> None:
        if self.comm.is_distributed and not self._schedule_known() and getattr(self, "_run_length", None) is None:
            warnings.warn(
                f"{type(self).__name__}: the variance freeze was not given and the run length is unknown, so "
                f"compression starts only at step {UNSET_FREEZE_STEP} (DeepSpeed's default). Call "
                "optimizer.set_run_length(num_training_steps, warmup_steps) before training, pass "
                "num_training_steps= to hf_zeroone.integrations.prepare_zeroone, or give the freeze step.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    # ------------------------------------------------------------------ groups and validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "schedule"):  # not during __init__
            try:
                check_param_group(self.param_groups[-1], type(self).__name__)
            except ValueError:
                self.param_groups.pop()  # refused: the optimizer stays as it was
                raise
            self._ranks_agree = False  # every rank adds it: the next step compares the groups again
            self.flat_cache.clear()
            self._group_of = None

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

    def exact_message_dtype(self, bucket_dtype: torch.dtype) -> torch.dtype:
        """The dtype an exact step averages a bucket of ``bucket_dtype`` in, on the hook's path and in ``step()``.

        ``exact_step_dtype`` applies to float32 buckets; fp16 and bf16 buckets go as they are, as
        DDP sends them, and so does every bucket when it is ``None``.
        """
        dtype = self.exact_step_dtype
        if dtype is torch.float8_e4m3fn:  # written in float32; the communicator encodes it
            return bucket_dtype
        return dtype if dtype is not None and bucket_dtype == torch.float32 else bucket_dtype

    def average_exact_async(
        self, message: Tensor, params: Sequence[Tensor], lane: Tensor | None
    ) -> torch.futures.Future:
        """Average an exact step's ``message`` (``params``' gradients end to end) and its ``lane`` over ranks, in place.

        float32 messages go as float8 messages, each parameter in blocks of its own, when
        ``exact_step_dtype`` is float8 (:meth:`~hf_zeroone.comm.Communicator.float8_allreduce_async`);
        the rest in an allreduce of their own dtype (:meth:`exact_message_dtype`). The hook's
        path and ``step()``'s both come here, and agree bit for bit whatever order DDP's bucket
        holds the parameters in.
        """
        if self.exact_step_dtype is torch.float8_e4m3fn and message.dtype == torch.float32:
            return self.comm.float8_allreduce_async(message, [p.numel() for p in params], lane)
        return self.comm.allreduce_mean_async(message, lane, lane_in_bf16=self.exact_step_dtype is torch.bfloat16)

    def grouped(self, params: Sequence[Tensor], values: Sequence[Any]) -> list[tuple[dict[str, Any], list, list]]:
        """``(group, params, values)`` per parameter group of ``params``, in order of first appearance."""
        params, values = list(params), list(values)
        if len(self.param_groups) == 1 and params and len(params) == len(values):
            self.group_of(params[0])  # builds the table
            if all(map(self._group_of.__contains__, map(id, params))):  # one group's, in the order given
                return [(self.param_groups[0], params, values)]
        return by_group([(self.group_of(p), p, v) for p, v in zip(params, values)])

    @property
    def comm_stats(self) -> CommStats:
        """Cumulative bytes and collectives this rank has sent (see :class:`CommStats`)."""
        return self.comm.stats

    def state_bytes(self) -> dict[str, int]:
        """Bytes of tensor storage this optimizer holds, by role (see :func:`._memory.state_bytes`)."""
        return _memory.state_bytes(self)

    # ------------------------------------------------------------------ checkpoints (see ._checkpoint)
    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state plus the schedule counters and this rank's identity (see :mod:`._checkpoint`).

        Warns when taken between two syncs of 0/1 Adam's local phase (replicas differ then): call
        :meth:`synchronize` on every rank first.
        """
        if not self.in_sync and self.comm.is_distributed:
            warnings.warn(
                f"{type(self).__name__}: state_dict() taken between two syncs (step {self.schedule['step']}): every "
                "rank holds parameters of its own. Call optimizer.synchronize() on every rank before saving "
                "(ZeroOneTrainer and prepare_zeroone's save_state do).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        return _checkpoint.add_extra(super().state_dict(), self)

    def defer_rank_state(self, state_dict: dict[str, Any]) -> None:
        """Make the next :meth:`load_state_dict` load ``state_dict`` instead of the state it is given.

        For frameworks that hand every rank the state saved by rank 0 (``accelerate``'s
        ``load_state``): each rank defers its own saved state first, keeping its error buffers.
        """
        self._deferred_state = state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; error buffers from another world size or rank are reset.

        Older checkpoints, whose ``server_error`` entries are full-size, load too.
        """
        deferred, self._deferred_state = getattr(self, "_deferred_state", None), None
        plain, restore = _checkpoint.split_for_torch(self, deferred if deferred is not None else state_dict)
        super().load_state_dict(plain)
        restore()
        loaded = [p for _, p in self.trainable_params() if "exp_avg" in self.state[p]]
        for key in ("exp_avg", "exp_avg_sq"):  # laid out flat again, as the first step makes them
            for p, flat in zip(loaded, zeros_like_flat([self.state[p][key] for p in loaded])):
                self.state[p][key] = flat.copy_(self.state[p][key])
        self._group_of = None  # torch's load puts new dicts in param_groups: the table's are stale
        self.flat_cache.clear()
        self.variance_views.clear()
        self._prepared_step = -1
        self._ranks_agree = False  # every rank loads: the next step compares the loaded settings
        self.communicated_step = None
        # a DDP hook says so again at its next call if the loaded schedule holds its passes per step
        self.hook_defers_some_steps = False
