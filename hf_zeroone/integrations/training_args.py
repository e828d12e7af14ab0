"""``ZeroOneTrainingArguments``: TrainingArguments with the 1-bit / 0/1 Adam settings as CLI flags.

The settings are a dataclass mixin, :class:`ZeroOneArgumentsMixin`, so any ``TrainingArguments``
subclass can carry them (TRL's ``SFTConfig``, ``Seq2SeqTrainingArguments``)::

    @dataclass
    class ZeroOneSFTConfig(ZeroOneArgumentsMixin, SFTConfig):
        pass

or ``with_zeroone(SFTConfig)``, which builds that class (:mod:`hf_zeroone.integrations`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import TrainingArguments

from hf_zeroone.comm import Communicator
from hf_zeroone.optim import DEFAULT_CHECK_REPLICAS_EVERY, OneBitAdam, OneBitDiLoCo, ZeroOneAdam
from hf_zeroone.optim._deepspeed import deepspeed_optimizer_section, optimizer_kwargs

OPTIMIZER_CHOICES = ("adamw_torch", "onebit_adam", "zeroone_adam", "onebit_diloco")
#: ``optim`` values the compressed optimizers stand in for: torch's AdamW (transformers' default, whatever the version)
_PLAIN_ADAMW = {"adamw_torch", "adamw_torch_fused", "adamw_hf"}
#: each optimizer's schedule fields (``compression_kwargs``); a field of the other one would be ignored
_OWN_SCHEDULE_FIELDS = {
    "onebit_adam": ("freeze_step",),
    "zeroone_adam": (
        "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "exact_warmup_steps",
    ),
    "onebit_diloco": ("sync_every", "outer_lr", "outer_momentum", "sync_passes", "sync_momentum"),
}  # fmt: skip
#: the fields only 1-bit Adam and 0/1 Adam read
_ADAM_ONLY = ("exact_step_dtype", "onebit_bias_correction", "overflow_check_on_local_steps")
_SCHEDULE_FIELDS = tuple(name for names in _OWN_SCHEDULE_FIELDS.values() for name in names)
#: the fields that only the optimizers built from these arguments read (none with optim_compression='adamw_torch')
_COMPRESSED_ONLY = (*_SCHEDULE_FIELDS, "exact_step_dtype", "onebit_bias_correction", "check_replicas_every")


def schedule_fields(optim_compression: str) -> tuple[str, ...]:
    """The schedule fields of ``ZeroOneTrainingArguments`` that ``optim_compression``'s optimizer takes."""
    return _OWN_SCHEDULE_FIELDS.get(optim_compression, ())


_CLASSES = {"onebit_adam": OneBitAdam, "zeroone_adam": ZeroOneAdam, "onebit_diloco": OneBitDiLoCo}

#: transformers 4.x has a ``warmup_ratio`` field; 5.x dropped it (a ``warmup_steps`` below 1 is the ratio there)
_BASE_HAS_WARMUP_RATIO = "warmup_ratio" in {f.name for f in fields(TrainingArguments)}
#: DeepSpeed's "auto" values, from the TrainingArguments that Hugging Face fills them with
_AUTO = {"lr": "learning_rate", "eps": "adam_epsilon", "weight_decay": "weight_decay"}


@dataclass
class ZeroOneArgumentsMixin:
    """The communication-compressed optimizer settings, for any ``TrainingArguments`` subclass (put it first).

    Every field is a command-line flag of ``HfArgumentParser`` and a key of a JSON config. Names of
    the schedule fields follow DeepSpeed. Steps left at ``None`` are derived from the run's ``T``
    optimizer steps and its LR warm-up ``W`` (the number of warm-up steps the LR scheduler uses;
    10% of the training steps when there is no warm-up) by the optimizer's ``set_run_length``:
    ``freeze_step = recommended_freeze_step(T, W)`` (the later of ``W`` and 30% of the run) for
    1-bit Adam; ``var_freeze_step = recommended_freeze_step(T, 2 W)`` for 0/1 Adam (every step
    before it exact unless ``exact_warmup_steps`` says otherwise), whose ``local_step_scaler`` and
    ``local_step_clipper`` come from ``recommended_local_steps`` (the largest sync gap 16 but at
    most a sixty-fourth of the local phase, reached a quarter of the way into it).

    ``warmup_ratio`` works on every supported transformers version: 4.x has the field; on 5.x,
    which dropped it (there a ``warmup_steps`` below 1 is a ratio), this class adds it and passes
    ``warmup_ratio=r`` on as ``warmup_steps=r``. So ``warmup_ratio=0.1`` (``--warmup_ratio 0.1``)
    and ``warmup_steps=100`` mean the same on 4.x and 5.x; ``warmup_steps=0.1`` is a ratio on 5.x only.
    """

    optim_compression: str = field(
        default="zeroone_adam",
        metadata={
            "help": "Optimizer: 'adamw_torch' (no compression, DDP's fp32 allreduce), 'onebit_adam' "
            "(1-bit Adam), 'zeroone_adam' (0/1 Adam) or 'onebit_diloco' (local AdamW steps, 1-bit DiLoCo syncs).",
            "choices": list(OPTIMIZER_CHOICES),
        },
    )
    from_deepspeed_config: str | None = field(
        default=None,
        metadata={
            "help": "A DeepSpeed config (JSON) whose optimizer section (OneBitAdam or ZeroOneAdam) defines the "
            "optimizer, for runs that passed --deepspeed only for it. Sets optim_compression; 'auto' values "
            "come from these arguments (learning_rate, adam_beta1/2, adam_epsilon, weight_decay)."
        },
    )
    freeze_step: int | None = field(
        default=None,
        metadata={
            "help": "1-bit Adam: exact steps before compression and the variance freeze (default: the later of "
            "the LR warm-up and 30 percent of the run)."
        },
    )
    var_freeze_step: int | None = field(
        default=None,
        metadata={
            "help": "0/1 Adam: variance freeze, first step of the local-step phase (default: the later of twice "
            "the LR warm-up and 30 percent of the run)."
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
            "most a sixty-fourth of the local phase, so that short runs still sync often)."
        },
    )
    exact_warmup_steps: int | None = field(
        default=None,
        metadata={
            "help": "0/1 Adam: first steps with exact (uncompressed) communication (default: all steps before "
            "var_freeze_step; 0: the paper's schedule, 1-bit gradients between sparse variance steps)."
        },
    )
    sync_every: int = field(default=4, metadata={"help": "1-bit DiLoCo: local AdamW steps between syncs (H)."})
    outer_lr: float = field(default=1.0, metadata={"help": "1-bit DiLoCo: the outer SGD's learning rate."})
    outer_momentum: float = field(
        default=0.0, metadata={"help": "1-bit DiLoCo: the outer SGD's Nesterov momentum (0: none)."}
    )
    sync_passes: int = field(
        default=1, metadata={"help": "1-bit DiLoCo: 1-bit allreduces per sync, each sending what the last left out."}
    )
    sync_momentum: bool = field(
        default=False,
        metadata={"help": "1-bit DiLoCo: also average the inner AdamW's update direction at every sync (2x bytes)."},
    )
    exact_step_dtype: str = field(
        default="float8_e4m3fn",
        metadata={
            "help": "Precision of the exact steps' gradient average (1-bit Adam's warm-up, 0/1 Adam's phase 1), "
            "most of a run's bytes: the default 'float8_e4m3fn' sends a quarter of fp32's (block-scaled float8 "
            "messages, two collectives); 'bfloat16' half, in one collective (the default before float8); "
            "'float32': full precision.",
            "choices": ["float8_e4m3fn", "bfloat16", "float32"],
        },
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
        default=DEFAULT_CHECK_REPLICAS_EVERY,
        metadata={
            "help": "Every N backward passes through the DDP hook (the Trainer's case), check that all ranks hold "
            "bit-identical parameters and step counters (one 24-byte all-gather) and stop with an error if not; "
            "without the hook, at the first synchronising step N steps after the last check. Default "
            f"{DEFAULT_CHECK_REPLICAS_EVERY}; 0 disables."
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
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
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
        if self.from_deepspeed_config is not None:
            self._adopt_deepspeed_config()
        self._check_compression_settings()

    def _check_compression_settings(self) -> None:
        """Refuse now what would be ignored or refused later, at ``train()``, after the model and data are set up."""
        defaults = {f.name: f.default for f in fields(self)}
        if self.optim_compression == "adamw_torch":
            # a warning, not an error: a comparison of optimizers may give every one the same flags
            unused = [n for n in _COMPRESSED_ONLY if getattr(self, n) != defaults[n]]
            if unused:
                warnings.warn(
                    f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect: "
                    "optim_compression='adamw_torch' trains with torch's AdamW, without compression. Set "
                    "optim_compression='onebit_adam', 'zeroone_adam' or 'onebit_diloco' for a compressed optimizer, "
                    "or drop them.",
                    UserWarning,
                    stacklevel=3,
                )
            return
        optim = str(getattr(self.optim, "value", self.optim))
        if optim not in _PLAIN_ADAMW | {str(getattr(defaults["optim"], "value", defaults["optim"]))}:
            raise ValueError(
                f"optim={optim!r} would be ignored: optim_compression={self.optim_compression!r} chooses the "
                "optimizer. Set optim_compression='adamw_torch' to let optim choose (no compression), or drop optim."
            )
        mine = self.compression_kwargs()
        other = [n for n in _SCHEDULE_FIELDS if n not in mine and getattr(self, n) != defaults[n]]
        if self.optim_compression == "onebit_diloco":
            other += [n for n in _ADAM_ONLY if getattr(self, n) != defaults[n]]
        if other:
            raise ValueError(
                f"{', '.join(other)} would be ignored: optim_compression={self.optim_compression!r} takes "
                f"{', '.join(mine)}. "
                "Choose the optimizer those settings belong to, or give its own."
            )
        try:  # the optimizer's own checks (integers, ranges, exact_step_dtype)
            self._stand_in_optimizer()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None

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

    def _adopt_deepspeed_config(self) -> None:
        """Take the optimizer and its settings from ``from_deepspeed_config`` into these arguments.

        A value the config gives replaces an argument left at its default (so the LR scheduler and
        the weight-decay groups see it too); one that contradicts an argument set on purpose is an
        error naming both. "auto" values are these arguments' own.
        """
        auto = {k: getattr(self, v) for k, v in _AUTO.items()} | {"betas": (self.adam_beta1, self.adam_beta2)}
        defaults = {f.name: f.default for f in fields(self)}
        given = [n for n in ("exact_step_dtype", "exact_warmup_steps") if getattr(self, n) != defaults[n]]
        if self.onebit_bias_correction != defaults["onebit_bias_correction"]:
            given.append("bias_correction")
        section = deepspeed_optimizer_section(self.from_deepspeed_config)
        cls, kwargs = optimizer_kwargs(section, auto=auto, given=given)
        self.optim_compression = next(name for name, c in _CLASSES.items() if c is cls)
        targets = dict(_AUTO, betas=("adam_beta1", "adam_beta2"), bias_correction="onebit_bias_correction")
        for key, value in kwargs.items():
            names = targets.get(key, key)
            for name, v in zip((names,) if isinstance(names, str) else names, value if key == "betas" else (value,)):
                current = getattr(self, name)
                if current != v and current != defaults[name]:
                    raise ValueError(
                        f"--{name} {current!r} and the DeepSpeed config's {key} {value!r} "
                        f'({self.from_deepspeed_config}) differ: give the value once (or "auto" in the config)'
                    )
                setattr(self, name, v)

    def warmup_for_schedule(self, num_training_steps: int) -> int:
        """The LR warm-up ``W`` the schedule follows: the scheduler's, or 10% of the run when it has none."""
        return self.get_warmup_steps(num_training_steps) or max(1, num_training_steps // 10)

    def compression_schedule(self, num_training_steps: int) -> dict[str, int]:
        """The schedule settings the optimizer gets for a run of ``num_training_steps`` (given or derived)."""
        if self.optim_compression == "adamw_torch":
            return {}
        probe = self._stand_in_optimizer()
        if not hasattr(probe, "set_run_length"):  # 1-bit DiLoCo: its settings do not depend on the run length
            return self.compression_kwargs()
        with warnings.catch_warnings():  # the real optimizer's set_run_length says what this one would
            warnings.simplefilter("ignore")
            probe.set_run_length(num_training_steps, self.warmup_for_schedule(num_training_steps))
        return {name: getattr(probe, name) for name in self.compression_kwargs()}

    def _stand_in_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer these arguments build, over one stand-in parameter, in this process alone."""
        return build_optimizer(self, [{"params": [torch.nn.Parameter(torch.zeros(1))]}], Communicator.local())

    def compression_kwargs(self) -> dict[str, Any]:
        """The optimizer's schedule arguments (steps left unset stay ``None``: the run length decides them)."""
        return {name: getattr(self, name) for name in schedule_fields(self.optim_compression)}


def build_optimizer(
    args: ZeroOneArgumentsMixin, groups: list[dict[str, Any]], communicator: Communicator | None = None
) -> torch.optim.Optimizer:
    """The optimizer ``args`` name, over ``groups`` (``from_deepspeed_config`` was taken into ``args``)."""
    common: dict[str, Any] = dict(
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        check_replicas_every=args.check_replicas_every,
        communicator=communicator,
    )
    if args.optim_compression != "onebit_diloco":
        common.update(bias_correction=args.onebit_bias_correction, exact_step_dtype=args.exact_step_dtype)
    return _CLASSES[args.optim_compression](groups, **common, **args.compression_kwargs())


@dataclass
class ZeroOneTrainingArguments(ZeroOneArgumentsMixin, TrainingArguments):
    """:class:`transformers.TrainingArguments` plus the settings of :class:`ZeroOneArgumentsMixin`."""


def arguments_with_zeroone(cls: type) -> type:
    """``cls`` (a ``TrainingArguments`` subclass) with :class:`ZeroOneArgumentsMixin`, as a dataclass."""
    if issubclass(cls, ZeroOneArgumentsMixin):
        return cls
    return dataclasses.dataclass(type(f"ZeroOne{cls.__name__}", (ZeroOneArgumentsMixin, cls), {}))
