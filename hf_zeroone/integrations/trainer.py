"""``ZeroOneTrainer``: a ``transformers.Trainer`` that trains with 1-bit / 0/1 Adam and the DDP hook."""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback

from hf_zeroone.comm import CommStats
from hf_zeroone.ddp_hook import ZeroOneHookState, register_zeroone_hook
from hf_zeroone.integrations.checkpoints import RANK_OPTIMIZER_NAME, read_rank_state, save_rank_state
from hf_zeroone.integrations.launch import check_distributed_launch, warn_single_process
from hf_zeroone.integrations.stats import comm_log_entries, unwrap_optimizer
from hf_zeroone.integrations.training_args import ZeroOneTrainingArguments
from hf_zeroone.optim import CompressedAdamBase, OneBitAdam, ZeroOneAdam

logger = logging.getLogger(__name__)

_SCHEDULER_NAME = "scheduler.pt"


class CommStatsCallback(TrainerCallback):
    """Registers the hf_zeroone DDP hook when training starts (the model is DDP-wrapped by then).

    In a single process it warns (:class:`~hf_zeroone.integrations.launch.SingleProcessWarning`)
    that the compressed optimizer sends nothing, naming the launch commands that start several.
    """

    def __init__(self, trainer: ZeroOneTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - Trainer's signature
        self.trainer._install_hook()
        opt = unwrap_optimizer(self.trainer.optimizer)
        if isinstance(opt, CompressedAdamBase) and args.world_size == 1 and opt.comm.world_size == 1:
            warn_single_process("ZeroOneTrainer", opt, "trainer")
        return control


class ZeroOneTrainer(Trainer):
    """A :class:`transformers.Trainer` that trains with 1-bit Adam or 0/1 Adam.

    * With :class:`~hf_zeroone.integrations.ZeroOneTrainingArguments`, the optimizer named by
      ``optim_compression`` is built with Hugging Face's weight-decay grouping and LR scheduler.
    * A user-built optimizer, ``ZeroOneTrainer(..., optimizers=(ZeroOneAdam(...), scheduler))``,
      is used as given.
    * Either way, when the model runs under DDP the hf_zeroone communication hook replaces DDP's
      fp32 gradient allreduce, and communication statistics go to the logs
      (:class:`CommStatsCallback`).
    * Checkpoints keep each rank's optimizer state (error buffers differ between ranks) in
      ``hf_zeroone_optimizer_rank{r}.pt`` beside the usual ``optimizer.pt``; resuming on the same
      world size continues exactly, on another world size the error buffers are reset with a
      warning.

    With plain ``TrainingArguments`` it behaves like ``Trainer`` except for the hook and logs.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_distributed_launch("ZeroOneTrainer")
        if self.args.world_size == 1 and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            raise RuntimeError(
                "ZeroOneTrainer: several processes were launched but the Trainer is not distributed; "
                "on a machine without GPUs pass use_cpu=True (--use_cpu) so Trainer uses DDP over gloo."
            )
        self._hook_state: ZeroOneHookState | None = None
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
        if isinstance(opt, CompressedAdamBase) and getattr(self.args, "log_comm_stats", True) and wanted:
            logs.update(comm_log_entries(opt, self._stats_at_last_log, self._hook_state is not None))
            self._stats_at_last_log = opt.comm_stats.copy()
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ optimizer
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        # transformers 4.x creates the optimizer here, before the new TrainerState holds max_steps.
        self._num_training_steps = num_training_steps
        super().create_optimizer_and_scheduler(num_training_steps)

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
            "ZeroOneTrainer cannot tell how many steps this run has, and the compression schedule's defaults "
            "depend on it: set max_steps, give a train_dataset with a length, or set freeze_step / "
            "var_freeze_step / exact_warmup_steps explicitly"
        )

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        args = self.args
        choice = getattr(args, "optim_compression", "adamw_torch")
        if self.optimizer is not None or choice == "adamw_torch":
            return super().create_optimizer(model) if model is not None else super().create_optimizer()
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        groups = [
            {
                "params": [p for n, p in opt_model.named_parameters() if n in decay and p.requires_grad],
                "weight_decay": args.weight_decay,
            },
            {
                "params": [p for n, p in opt_model.named_parameters() if n not in decay and p.requires_grad],
                "weight_decay": 0.0,
            },
        ]
        groups = [g for g in groups if g["params"]]
        assert isinstance(args, ZeroOneTrainingArguments)
        schedule = args.compression_schedule(self._training_steps())
        common = dict(
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            bias_correction=args.onebit_bias_correction,
            check_replicas_every=args.check_replicas_every,
        )
        cls = OneBitAdam if choice == "onebit_adam" else ZeroOneAdam
        self.optimizer = cls(groups, **common, **schedule)
        logger.info("hf_zeroone: %s with %s", cls.__name__, schedule)
        return self.optimizer

    # ------------------------------------------------------------------ hook
    def _install_hook(self) -> None:
        opt = unwrap_optimizer(self.optimizer)
        if not isinstance(opt, CompressedAdamBase):
            return
        model = self.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            if opt.comm.world_size > 1:
                warnings.warn(
                    f"ZeroOneTrainer: the model is not wrapped in DistributedDataParallel "
                    f"({type(model).__name__}); {type(opt).__name__} communicates in step() instead of "
                    "during backward",
                    stacklevel=2,
                )
            return
        if self._hook_state is None or self._hook_state.optimizer is not opt:
            state = register_zeroone_hook(model, opt, grad_scaler=getattr(self.accelerator, "scaler", None))
            check = getattr(self.args, "overflow_check_on_local_steps", None)
            state.overflow_check_on_local_steps = bool(self.args.fp16) if check is None else check
            self._hook_state = state
            logger.info("hf_zeroone: communication hook registered on the DDP model")

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        opt = unwrap_optimizer(self.optimizer)
        if isinstance(opt, CompressedAdamBase):
            save_rank_state(opt, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opt = unwrap_optimizer(self.optimizer)
        if checkpoint is None or not isinstance(opt, CompressedAdamBase):
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


__all__ = ["RANK_OPTIMIZER_NAME", "CommStatsCallback", "ZeroOneTrainer"]
