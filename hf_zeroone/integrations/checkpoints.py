"""Per-rank optimizer state in a checkpoint folder (error buffers differ between ranks).

``transformers.Trainer`` and ``accelerate.Accelerator.save_state`` save the optimizer state of
rank 0 only, and every rank loads that one file: the other ranks' error-feedback buffers would be
reset on resume. These helpers keep one file per rank beside the usual ones.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hf_zeroone.optim import CompressedAdamBase

#: per-rank optimizer state file in a checkpoint folder
RANK_OPTIMIZER_NAME = "hf_zeroone_optimizer_rank{rank}.pt"

__all__ = ["RANK_OPTIMIZER_NAME", "rank_state_path", "read_rank_state", "save_rank_state"]


def rank_state_path(folder: str, optimizer: CompressedAdamBase) -> str:
    return os.path.join(folder, RANK_OPTIMIZER_NAME.format(rank=optimizer.comm.rank))


def save_rank_state(optimizer: CompressedAdamBase, folder: str) -> str:
    """Write this rank's ``optimizer.state_dict()`` into ``folder``; returns the file's path."""
    os.makedirs(folder, exist_ok=True)
    path = rank_state_path(folder, optimizer)
    torch.save(optimizer.state_dict(), path)
    return path


def read_rank_state(optimizer: CompressedAdamBase, folder: str) -> dict[str, Any] | None:
    """This rank's saved state from ``folder`` (tensors on CPU), or ``None`` if there is none."""
    path = rank_state_path(folder, optimizer)
    if not os.path.isfile(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
