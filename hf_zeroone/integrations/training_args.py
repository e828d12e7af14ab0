"""``ZeroOneTrainingArguments``: TrainingArguments with the 1-bit / 0/1 Adam settings as CLI flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from transformers import TrainingArguments

from hf_zeroone.optim import recommended_freeze_step, recommended_local_steps

OPTIMIZER_CHOICES = ("adamw_torch", "onebit_adam", "zeroone_adam")

#: transformers 4.x has a ``warmup_ratio`` field; 5.x dropped it (a ``warmup_steps`` below 1 is the ratio there)
_BASE_HAS_WARMUP_RATIO = "warmup_ratio" in {f.name for f in fields(TrainingArguments)}


@dataclass
class ZeroOneTrainingArguments(TrainingArguments):
    """:class:`transformers.TrainingArguments` plus the communication-compressed optimizer settings.

    Every field is a command-line flag of ``HfArgumentParser`` and a key of a JSON config. Names of
    the schedule fields follow DeepSpeed. Steps left at ``None`` are derived from the run's ``T``
    optimizer steps and its LR warm-up ``W`` (the number of warm-up steps the LR scheduler uses;
    10% of the training steps when there is no warm-up), with
    :func:`hf_zeroone.optim.recommended_freeze_step` (the later of its argument and 20% of the run):
    ``freeze_step = recommended_freeze_step(T, W)`` for 1-bit Adam; ``exact_warmup_steps = W`` and
    ``var_freeze_step = recommended_freeze_step(T, 2 W)`` for 0/1 Adam, whose ``local_step_scaler`` and
    ``local_step_clipper`` come from :func:`hf_zeroone.optim.recommended_local_steps` (the largest sync
    gap 16 but at most a sixteenth of the local phase, reached a quarter of the way into it).

    ``warmup_ratio`` works on every supported transformers version: 4.x has the field; on 5.x,
    which dropped it (there a ``warmup_steps`` below 1 is a ratio), this class adds it and passes
    ``warmup_ratio=r`` on as ``warmup_steps=r``. So ``warmup_ratio=0.1`` (``--warmup_ratio 0.1``)
    and ``warmup_steps=100`` mean the same on 4.x and 5.x; ``warmup_steps=0.1`` is a ratio on 5.x only.
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
        metadata={
            "help": "1-bit Adam: exact steps before compression and the variance freeze (default: the later of "
            "the LR warm-up and a fifth of the run)."
        },
    )
    var_freeze_step: int | None = field(
        default=None,
        metadata={
            "help": "0/1 Adam: variance freeze, first step of the local-step phase (default: the later of twice "
            "the LR warm-up and a fifth of the run)."
        },
    )
    var_update_scaler: int = field(
        default=16,
        metadata={"help": "0/1 Adam: variance updates between doublings of the variance-update gap."},
    )
    local_step_scaler: int | None = field(
        default=None,
        metadata={
            "help": "0/1 Adam: local-phase steps between doublings of the sync gap (default: derived from the run "
            "length, so that the gap reaches local_step_clipper a quarter of the way into the local phase; "
            "DeepSpeed's default is 32678)."
        },
    )
    local_step_clipper: int | None = field(
        default=None,
        metadata={
            "help": "0/1 Adam: largest gap between syncs in the local phase (default: 16, the paper's H, but at "
            "most a sixteenth of the local phase, so that short runs still sync often)."
        },
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
        metadata={
            "help": "Add communication statistics (bytes, ratio vs fp32, phase) to the training logs: on every "
            "loss-logging step and in the final training summary."
        },
    )
    if not _BASE_HAS_WARMUP_RATIO:  # transformers >= 5: keep the 4.x flag working
        warmup_ratio: float = field(
            default=0.0,
            metadata={
                "help": "Fraction of the training steps used for a linear LR warm-up, in [0, 1) (passed on as "
                "warmup_steps, which takes a ratio below 1 on this transformers version)."
            },
        )

    def __post_init__(self) -> None:
        if not _BASE_HAS_WARMUP_RATIO:
            self._warmup_ratio_to_steps()
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
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def _warmup_ratio_to_steps(self) -> None:
        ratio = self.warmup_ratio
        if ratio is None or ratio == 0:
            return
        if not 0 < ratio < 1 or math.isnan(ratio):
            raise ValueError(f"warmup_ratio must be in [0, 1), got {ratio}; give a number of steps with warmup_steps")
        if self.warmup_steps and self.warmup_steps != ratio:
            raise ValueError(
                f"give warmup_ratio ({ratio}) or warmup_steps ({self.warmup_steps}), not both: on transformers 5 "
                "both set the same warm-up"
            )
        self.warmup_steps = ratio

    def compression_schedule(self, num_training_steps: int) -> dict[str, int]:
        """The optimizer keyword arguments for the schedule, with defaults derived from the warm-up."""
        warmup = self.get_warmup_steps(num_training_steps) or max(1, num_training_steps // 10)
        if self.optim_compression == "onebit_adam":
            derived = recommended_freeze_step(num_training_steps, warmup)
            return {"freeze_step": derived if self.freeze_step is None else self.freeze_step}
        if self.optim_compression == "zeroone_adam":
            derived = recommended_freeze_step(num_training_steps, 2 * warmup)
            var_freeze = derived if self.var_freeze_step is None else self.var_freeze_step
            local = recommended_local_steps(num_training_steps, var_freeze, self.local_step_clipper)
            if self.local_step_scaler is not None:
                local["local_step_scaler"] = self.local_step_scaler
            return {
                "var_freeze_step": var_freeze,
                "exact_warmup_steps": warmup if self.exact_warmup_steps is None else self.exact_warmup_steps,
                "var_update_scaler": self.var_update_scaler,
                **local,
            }
        return {}
