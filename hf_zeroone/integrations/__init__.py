"""Hugging Face integrations: the only part of hf_zeroone that imports transformers / accelerate.

Names are imported on first use so that ``import hf_zeroone`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ZeroOneTrainingArguments": "hf_zeroone.integrations.training_args",
    "ZeroOneTrainer": "hf_zeroone.integrations.trainer",
    "ZeroOneTrainerMixin": "hf_zeroone.integrations.trainer",
    "ZeroOneArgumentsMixin": "hf_zeroone.integrations.training_args",
    "with_zeroone": "hf_zeroone.integrations.trainer",
    "CommStatsCallback": "hf_zeroone.integrations.trainer",
    "prepare_zeroone": "hf_zeroone.integrations.accelerate_plugin",
    "check_distributed_launch": "hf_zeroone.integrations.launch",
    "SingleProcessWarning": "hf_zeroone.integrations.launch",
    "comm_log_entries": "hf_zeroone.integrations.stats",
    "RANK_OPTIMIZER_NAME": "hf_zeroone.integrations.checkpoints",
    "save_rank_state": "hf_zeroone.integrations.checkpoints",
    "read_rank_state": "hf_zeroone.integrations.checkpoints",
    "unwrap_optimizer": "hf_zeroone.integrations.stats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hf_zeroone.integrations' has no attribute {name!r}")
