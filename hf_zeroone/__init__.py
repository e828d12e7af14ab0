"""hf_zeroone: 1-bit Adam, 0/1 Adam and 1-bit DiLoCo for PyTorch DDP and the Hugging Face stack.

``import hf_zeroone`` imports torch only; the Hugging Face integrations live in
:mod:`hf_zeroone.integrations` and are imported on first use.
"""

from hf_zeroone.comm import CommStats, Communicator
from hf_zeroone.compression import ChunkLayout
from hf_zeroone.ddp_hook import ZeroOneHookState, local_gradients_hook, register_zeroone_hook, zeroone_hook
from hf_zeroone.optim import (
    CompressedAdamBase,
    DeepSpeedConfigNote,
    OneBitAdam,
    OneBitDiLoCo,
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
    "OneBitDiLoCo",
    "StepKind",
    "ZeroOneAdam",
    "ZeroOneHookState",
    "ZeroOneTrainer",
    "ZeroOneTrainerMixin",
    "ZeroOneTrainingArguments",
    "__version__",
    "from_deepspeed_config",
    "local_gradients_hook",
    "prepare_zeroone",
    "recommended_freeze_step",
    "recommended_local_steps",
    "register_zeroone_hook",
    "with_zeroone",
    "zeroone_hook",
]
