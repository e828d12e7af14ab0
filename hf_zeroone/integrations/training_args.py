"""``ZeroOneTrainingArguments``: TrainingArguments with the 1-bit / 0/1 Adam settings as CLI flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

OPTIMIZER_CHOICES = ("adamw_torch", "onebit_adam", "zeroone_adam")


@dataclass
class ZeroOneTrainingArguments(TrainingArguments):
    """:class:`transformers.TrainingArguments` plus the communication-compressed optimizer settings.

    Every field is a command-line flag of ``HfArgumentParser`` and a key of a JSON config. Names of
    the schedule fields follow DeepSpeed. Steps left at ``None`` are derived from the LR warm-up
    ``W`` (``warmup_steps``, or ``warmup_ratio`` of the training steps; 10% of the training steps
    when both are 0): ``freeze_step = W`` for 1-bit Adam; ``exact_warmup_steps = W`` and
    ``var_freeze_step = 2 W`` for 0/1 Adam.
    """

    optim_compression: str = field(
        default="zeroone_adam",
        metadata={
            "help": "Optimizer: 'adamw_torch' (no compression, DDP's fp32 allreduce), 'onebit_adam' "
            "(1-bit Adam) or 'zeroone_adam' (0/1 Adam).",
            "choices": list(OPTIMIZER_CHOICES),
        },
    )
    freeze_step: int | None = field(
        default=None,
        metadata={"help": "1-bit Adam: exact warm-up steps before compression (default: the LR warm-up)."},
    )
    var_freeze_step: int | None = field(
        default=None,
        metadata={"help": "0/1 Adam: first step of the local-step phase (default: twice the LR warm-up)."},
    )
    var_update_scaler: int = field(
        default=16,
        metadata={"help": "0/1 Adam: variance updates between doublings of the variance-update gap."},
    )
    local_step_scaler: int = field(
        default=32678,
        metadata={"help": "0/1 Adam: local-phase steps between doublings of the sync gap (DeepSpeed default)."},
    )
    local_step_clipper: int = field(
        default=16,
        metadata={"help": "0/1 Adam: largest gap between syncs in the local phase."},
    )
    exact_warmup_steps: int | None = field(
        default=None,
        metadata={"help": "0/1 Adam: first steps with exact (fp32) communication (default: the LR warm-up)."},
    )
    onebit_bias_correction: bool = field(
        default=True,
        metadata={"help": "Adam bias correction (False reproduces DeepSpeed, which has none)."},
    )
    overflow_check_on_local_steps: bool | None = field(
        default=None,
        metadata={
            "help": "0/1 Adam: agree across ranks on inf/NaN gradients on local steps (one 4-byte allreduce "
            "per bucket) so a GradScaler skips together. Default: on with --fp16."
        },
    )
    check_replicas_every: int = field(
        default=0,
        metadata={
            "help": "Every N synchronising steps, check that all ranks hold bit-identical parameters (one "
            "16-byte all-gather) and stop with an error if not. 0 disables."
        },
    )
    log_comm_stats: bool = field(
        default=True,
        metadata={"help": "Add communication statistics (bytes, ratio vs fp32, phase) to the training logs."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.optim_compression not in OPTIMIZER_CHOICES:
            raise ValueError(
                f"optim_compression must be one of {', '.join(OPTIMIZER_CHOICES)}, got {self.optim_compression!r}"
            )
        for name in ("freeze_step", "var_freeze_step", "exact_warmup_steps"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.check_replicas_every < 0:
            raise ValueError(f"check_replicas_every must be >= 0, got {self.check_replicas_every}")
        for name in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def compression_schedule(self, num_training_steps: int) -> dict[str, int]:
        """The optimizer keyword arguments for the schedule, with defaults derived from the warm-up."""
        warmup = self.get_warmup_steps(num_training_steps) or max(1, num_training_steps // 10)
        if self.optim_compression == "onebit_adam":
            return {"freeze_step": warmup if self.freeze_step is None else self.freeze_step}
        if self.optim_compression == "zeroone_adam":
            return {
                "var_freeze_step": 2 * warmup if self.var_freeze_step is None else self.var_freeze_step,
                "exact_warmup_steps": warmup if self.exact_warmup_steps is None else self.exact_warmup_steps,
                "var_update_scaler": self.var_update_scaler,
                "local_step_scaler": self.local_step_scaler,
                "local_step_clipper": self.local_step_clipper,
            }
        return {}
