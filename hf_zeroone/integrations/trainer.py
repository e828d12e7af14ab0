"""``ZeroOneTrainer``: a ``transformers.Trainer`` that trains with 1-bit / 0/1 Adam and the DDP hook.

The behaviour lives in :class:`ZeroOneTrainerMixin`, so that any ``Trainer`` subclass can have it
(TRL's ``SFTTrainer``, ``Seq2SeqTrainer``, a team's own)::

    class ZeroOneSFTTrainer(ZeroOneTrainerMixin, SFTTrainer):
        pass

or ``with_zeroone(SFTTrainer)``, which builds that class (and ``with_zeroone(SFTConfig)`` its
arguments, see :mod:`hf_zeroone.integrations.training_args`).
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_zeroone.comm import CommStats
from hf_zeroone.ddp_hook import ZeroOneHookState, register_zeroone_hook
from hf_zeroone.integrations.checkpoints import RANK_OPTIMIZER_NAME, read_rank_state, save_rank_state
from hf_zeroone.integrations.launch import check_distributed_launch, warn_single_process
from hf_zeroone.integrations.stats import comm_log_entries, unwrap_optimizer
from hf_zeroone.integrations.training_args import ZeroOneArgumentsMixin, arguments_with_zeroone, build_optimizer
from hf_zeroone.optim import HF_ZEROONE_OPTIMIZERS, CompressedAdamBase

logger = logging.getLogger(__name__)

_SCHEDULER_NAME = "scheduler.pt"


class CommStatsCallback(TrainerCallback):
    """Registers the hf_zeroone DDP hook when training starts, and keeps replicas whole where one model counts.

    * ``on_train_begin``: the hook goes on the DDP model (the Trainer wraps it by then). In a
      single process it warns (:class:`~hf_zeroone.integrations.launch.SingleProcessWarning`)
      that the compressed optimizer sends nothing, naming the launch commands that start several.
    * Before a checkpoint and at the end of training, 0/1 Adam's replicas, which differ between
      syncs, are synced (:meth:`~hf_zeroone.optim.ZeroOneAdam.synchronize`): the saved model, the
      final evaluation and the model ``train()`` leaves are the one every rank holds. Before an
      evaluation in the middle of the local phase they are not (a sync would change the run); a
      warning says so once.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._warned_eval = False

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - Trainer's signature
        self.trainer._install_hook()
        opt = unwrap_optimizer(self.trainer.optimizer)
        if isinstance(opt, HF_ZEROONE_OPTIMIZERS) and args.world_size == 1 and opt.comm.world_size == 1:
            warn_single_process(type(self.trainer).__name__, opt, "trainer")
        return control

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        # DefaultFlowCallback ran before this one: control says what happens after this step
        self._before_save_or_evaluate(control, last=state.max_steps > 0 and state.global_step >= state.max_steps)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self._before_save_or_evaluate(control, last=False)
        return control

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self._sync("the end of training")
        return control

    def _before_save_or_evaluate(self, control, last: bool) -> None:  # noqa: ANN001
        if last or control.should_save:
            self._sync("the end of training" if last else "a checkpoint")
        elif control.should_evaluate:
            opt = unwrap_optimizer(self.trainer.optimizer)
            if isinstance(opt, HF_ZEROONE_OPTIMIZERS) and not opt.in_sync and not self._warned_eval:
                self._warned_eval = True
                warnings.warn(
                    f"{type(self.trainer).__name__}: evaluating between two syncs of {type(opt).__name__}'s local "
                    "phase: each rank evaluates the parameters of its own local steps. Evaluate at save steps "
                    "(replicas are synced before every checkpoint) or call optimizer.synchronize() in a callback.",
                    UserWarning,
                    stacklevel=2,
                )

    def _sync(self, why: str) -> None:
        opt = unwrap_optimizer(self.trainer.optimizer)
        if isinstance(opt, HF_ZEROONE_OPTIMIZERS) and opt.synchronize():
            logger.info("hf_zeroone: replicas synced before %s", why)


class ZeroOneTrainerMixin:
    """What makes a ``transformers.Trainer`` (or any subclass of it) train with 1-bit Adam or 0/1 Adam.

    Put it first among the bases: ``class MyTrainer(ZeroOneTrainerMixin, SomeTrainer)``.

    * With arguments that carry the compression settings (:class:`~hf_zeroone.ZeroOneTrainingArguments`,
      or any ``TrainingArguments`` subclass with :class:`ZeroOneArgumentsMixin`), the optimizer
      named by ``optim_compression`` is built with Hugging Face's weight-decay grouping and LR
      scheduler, its schedule derived from the run's length and warm-up.
    * A user-built optimizer, ``optimizers=(ZeroOneAdam(...), scheduler)``, is used as given (its
      schedule still follows the run length where it left it unset).
    * Either way, when the model runs under DDP the hf_zeroone communication hook replaces DDP's
      fp32 gradient allreduce, communication statistics go to the logs, and 0/1 Adam's replicas are
      synced before every checkpoint and at the end of training (:class:`CommStatsCallback`).
    * Checkpoints keep each rank's optimizer state (error buffers differ between ranks) in
      ``hf_zeroone_optimizer_rank{r}.pt`` beside the usual ``optimizer.pt``; resuming on the same
      world size continues exactly, on another world size the error buffers are reset with a
      warning.
    * Launch mistakes stop with an error that names the fix (several processes that did not form
      one data-parallel group).

    With plain ``TrainingArguments`` it behaves like the Trainer it is mixed into, plus the hook and logs.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        name = type(self).__name__
        check_distributed_launch(name)
        if self.args.world_size == 1 and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            raise RuntimeError(
                f"{name}: several processes were launched but the Trainer is not distributed; "
                "on a machine without GPUs pass use_cpu=True (--use_cpu) so Trainer uses DDP over gloo."
            )
        self._hook_state: ZeroOneHookState | None = None
        self._hooked_optimizer: torch.optim.Optimizer | None = None
        self._stats_at_last_log = CommStats()
        self.add_callback(CommStatsCallback(self))

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add communication statistics (:func:`~hf_zeroone.integrations.stats.comm_log_entries`).

        On every loss-logging step and in the training summary logged when ``train()`` ends (so a
        run shorter than ``logging_steps`` has them too). Numbers only, so ``log_history`` and
        every ``report_to`` backend get them.
        """
        opt = unwrap_optimizer(self.optimizer)
        wanted = "loss" in logs or "train_loss" in logs
        if isinstance(opt, HF_ZEROONE_OPTIMIZERS) and getattr(self.args, "log_comm_stats", True) and wanted:
            logs.update(comm_log_entries(opt, self._stats_at_last_log, self._hooked_optimizer is opt))
            self._stats_at_last_log = opt.comm_stats.copy()
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ optimizer
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        # transformers 4.x creates the optimizer here, before the new TrainerState holds max_steps.
        self._num_training_steps = num_training_steps
        super().create_optimizer_and_scheduler(num_training_steps)

    def _run_length(self) -> tuple[int, int]:
        """The run's optimizer steps ``T`` and LR warm-up ``W`` (10% of ``T`` when the LR has none)."""
        steps = self._training_steps()
        return steps, ZeroOneArgumentsMixin.warmup_for_schedule(self.args, steps)

    def _training_steps(self) -> int:
        """The run's optimizer steps, for the schedule defaults; raise if they cannot be known yet."""
        for steps in (getattr(self, "_num_training_steps", None), self.state.max_steps, self.args.max_steps):
            if steps is not None and steps > 0:
                return int(steps)
        if self.train_dataset is not None and hasattr(self.train_dataset, "__len__"):
            per_epoch = len(self.get_train_dataloader()) // max(1, self.args.gradient_accumulation_steps)
            steps = math.ceil(max(1, per_epoch) * self.args.num_train_epochs)
            if steps > 0:
                return steps
        raise ValueError(
            f"{type(self).__name__} cannot tell how many steps this run has, and the compression schedule's "
            "defaults depend on it: set max_steps, give a train_dataset with a length, or set freeze_step / "
            "var_freeze_step / exact_warmup_steps explicitly"
        )

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        choice = getattr(self.args, "optim_compression", "adamw_torch")
        if self.optimizer is not None or choice == "adamw_torch":
            opt = super().create_optimizer(model) if model is not None else super().create_optimizer()
            inner = unwrap_optimizer(opt)
            if isinstance(inner, CompressedAdamBase) and inner.schedule["step"] == 0:
                inner.set_run_length(*self._run_length())  # a user-built optimizer: what it left unset
            return opt
        if not isinstance(self.args, ZeroOneArgumentsMixin):
            raise TypeError(f"optim_compression needs arguments with ZeroOneArgumentsMixin, got {type(self.args)}")
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        groups = [
            {"params": [p for n, p in opt_model.named_parameters() if n in decay and p.requires_grad]},
            {"params": [p for n, p in opt_model.named_parameters() if n not in decay and p.requires_grad]},
        ]
        groups[0]["weight_decay"], groups[1]["weight_decay"] = self.args.weight_decay, 0.0
        self.optimizer = build_optimizer(self.args, [g for g in groups if g["params"]])
        if isinstance(self.optimizer, CompressedAdamBase):
            self.optimizer.set_run_length(*self._run_length())
        logger.info("hf_zeroone: %s", type(self.optimizer).__name__)
        return self.optimizer

    # ------------------------------------------------------------------ hook
    def _install_hook(self) -> None:
        opt = unwrap_optimizer(self.optimizer)
        if not isinstance(opt, HF_ZEROONE_OPTIMIZERS):
            return
        model = self.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            if opt.comm.world_size > 1:
                warnings.warn(
                    f"{type(self).__name__}: the model is not wrapped in DistributedDataParallel "
                    f"({type(model).__name__}); {type(opt).__name__} communicates in step() instead of "
                    "during backward",
                    stacklevel=2,
                )
            return
        if getattr(self, "_hooked_optimizer", None) is not opt:
            state = register_zeroone_hook(model, opt, grad_scaler=getattr(self.accelerator, "scaler", None))
            if state is not None:
                check = getattr(self.args, "overflow_check_on_local_steps", None)
                state.overflow_check_on_local_steps = bool(self.args.fp16) if check is None else check
            self._hook_state, self._hooked_optimizer = state, opt
            logger.info("hf_zeroone: communication hook registered on the DDP model")

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        opt = unwrap_optimizer(self.optimizer)
        if isinstance(opt, HF_ZEROONE_OPTIMIZERS):
            save_rank_state(opt, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opt = unwrap_optimizer(self.optimizer)
        if checkpoint is None or not isinstance(opt, HF_ZEROONE_OPTIMIZERS):
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = read_rank_state(opt, checkpoint)
        if state is None:
            fallback = os.path.join(checkpoint, "optimizer.pt")
            if not os.path.isfile(fallback):
                return super()._load_optimizer_and_scheduler(checkpoint)
            logger.warning("hf_zeroone: no per-rank optimizer state for rank %d in %s", opt.comm.rank, checkpoint)
            state = torch.load(fallback, map_location="cpu", weights_only=True)
        opt.load_state_dict(state)
        scheduler = os.path.join(checkpoint, _SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's "please also save optimizer" notice
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


class ZeroOneTrainer(ZeroOneTrainerMixin, Trainer):
    """A :class:`transformers.Trainer` that trains with 1-bit Adam or 0/1 Adam (see :class:`ZeroOneTrainerMixin`)."""


_EQUIPPED: dict[type, type] = {}


def with_zeroone(cls: type) -> type:
    """``cls`` with hf_zeroone's behaviour: a ``Trainer`` subclass gets :class:`ZeroOneTrainerMixin`, a
    ``TrainingArguments`` subclass :class:`~hf_zeroone.integrations.training_args.ZeroOneArgumentsMixin`.

    For a Trainer subclass you did not write (TRL's ``SFTTrainer``, ``Seq2SeqTrainer``)::

        SFTTrainer, SFTConfig = with_zeroone(SFTTrainer), with_zeroone(SFTConfig)
        trainer = SFTTrainer(model=..., args=SFTConfig(..., optim_compression="zeroone_adam"), ...)

    The same class comes back for the same ``cls``; a class that has the mixin already is returned as it is.
    """
    if isinstance(cls, type) and issubclass(cls, TrainingArguments):
        return arguments_with_zeroone(cls)
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"with_zeroone takes a Trainer or TrainingArguments subclass, got {cls!r}")
    if issubclass(cls, ZeroOneTrainerMixin):
        return cls
    if cls not in _EQUIPPED:
        _EQUIPPED[cls] = type(f"ZeroOne{cls.__name__}", (ZeroOneTrainerMixin, cls), {"__module__": cls.__module__})
    return _EQUIPPED[cls]


__all__ = ["RANK_OPTIMIZER_NAME", "CommStatsCallback", "ZeroOneTrainer", "ZeroOneTrainerMixin", "with_zeroone"]
