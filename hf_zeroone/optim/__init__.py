"""Communication-compressed Adam optimizers."""

from hf_zeroone.optim._base import DEFAULT_CHECK_REPLICAS_EVERY, CompressedAdamBase, StepKind
from hf_zeroone.optim._deepspeed import DeepSpeedConfigNote, from_deepspeed_config
from hf_zeroone.optim._memory import bytes_per_parameter, documented_bytes_per_param, state_bytes
from hf_zeroone.optim._schedule import (
    FREEZE_PERCENT,
    LOCAL_PHASE_SYNCS,
    recommended_freeze_step,
    recommended_local_steps,
)
from hf_zeroone.optim.onebit_adam import OneBitAdam
from hf_zeroone.optim.onebit_diloco import OneBitDiLoCo
from hf_zeroone.optim.zeroone_adam import ZeroOneAdam

#: every optimizer of the package: what the DDP hook, the Trainer and the Accelerate plugin take
HF_ZEROONE_OPTIMIZERS = (CompressedAdamBase, OneBitDiLoCo)

__all__ = [
    "HF_ZEROONE_OPTIMIZERS",
    "DEFAULT_CHECK_REPLICAS_EVERY",
    "FREEZE_PERCENT",
    "LOCAL_PHASE_SYNCS",
    "CompressedAdamBase",
    "DeepSpeedConfigNote",
    "OneBitAdam",
    "OneBitDiLoCo",
    "StepKind",
    "ZeroOneAdam",
    "bytes_per_parameter",
    "from_deepspeed_config",
    "documented_bytes_per_param",
    "recommended_freeze_step",
    "recommended_local_steps",
    "state_bytes",
]
