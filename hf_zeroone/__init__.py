"""hf_zeroone: 1-bit Adam and 0/1 Adam for PyTorch DDP and the Hugging Face stack.

``import hf_zeroone`` imports torch only; the Hugging Face integrations live in
:mod:`hf_zeroone.integrations` and are imported on first use.
"""

from hf_zeroone.comm import CommStats, Communicator
from hf_zeroone.compression import ChunkLayout
from hf_zeroone.ddp_hook import ZeroOneHookState, register_zeroone_hook, zeroone_hook
from hf_zeroone.optim import (
    CompressedAdamBase,
    DeepSpeedConfigNote,
    OneBitAdam,
    StepKind,
    ZeroOneAdam,
    from_deepspeed_config,
    recommended_freeze_step,
    recommended_local_steps,
)

__version__ = "0.1.0"

_LAZY = {"ZeroOneTrainer", "ZeroOneTrainerMixin", "ZeroOneTrainingArguments", "prepare_zeroone", "with_zeroone"}


def __getattr__(name: str):  # the HF integrations import transformers: load them on first use
    if name in _LAZY:
        from hf_zeroone import integrations

        return getattr(integrations, name)
    raise AttributeError(f"module 'hf_zeroone' has no attribute {name!r}")


__all__ = [
    "ChunkLayout",
    "CommStats",
    "Communicator",
    "CompressedAdamBase",
    "DeepSpeedConfigNote",
    "OneBitAdam",
    "StepKind",
    "ZeroOneAdam",
    "ZeroOneHookState",
    "ZeroOneTrainer",
    "ZeroOneTrainerMixin",
    "ZeroOneTrainingArguments",
    "__version__",
    "from_deepspeed_config",
    "prepare_zeroone",
    "recommended_freeze_step",
    "recommended_local_steps",
    "register_zeroone_hook",
    "with_zeroone",
    "zeroone_hook",
]
