"""Detect launches that silently train independent copies instead of one data-parallel job."""

from __future__ import annotations

import os

import torch.distributed as dist

CPU_LAUNCH_HELP = (
    "Working two-process CPU launches:\n"
    "    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 script.py ...\n"
    "    torchrun --nproc_per_node 2 script.py ... --use_cpu   (Trainer scripts)\n"
    "(`accelerate launch --cpu --num_processes 2` starts ONE process.)"
)


def check_distributed_launch(what: str = "this script") -> int:
    """Raise if the launcher started several processes but they did not join one process group.

    ``torchrun`` and ``accelerate launch`` set ``WORLD_SIZE``; if it is above 1 while
    ``torch.distributed`` is not initialised (or has another size), every process would train alone
    and nothing would be averaged -- silently. Returns the world size.
    """
    env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    if env_world > 1 and world != env_world:
        raise RuntimeError(
            f"{what}: the launcher started {env_world} processes (WORLD_SIZE={env_world}) but they are "
            f"not one data-parallel group (torch.distributed world size {world}); each would train "
            "alone. On a machine without GPUs tell the launcher to use the CPU.\n" + CPU_LAUNCH_HELP
        )
    return world
