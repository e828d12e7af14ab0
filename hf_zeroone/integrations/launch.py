"""Launch mistakes that would otherwise go unnoticed: independent copies, or one process where several were meant."""

from __future__ import annotations

import os
import warnings

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


class SingleProcessWarning(UserWarning):
    """A compressed optimizer runs in a single process: it sends nothing and compresses nothing."""


#: working launch commands, one line each, by the kind of script
_LAUNCH_HINTS = {
    "accelerate": "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 script.py (CPU) or "
    "accelerate launch --num_processes N script.py (GPUs); `accelerate launch --cpu --num_processes 2` starts ONE "
    "process",
    "trainer": "torchrun --nproc_per_node 2 script.py --use_cpu (CPU) or torchrun --nproc_per_node N script.py (GPUs)",
}


def warn_single_process(what: str, optimizer: object, script: str = "accelerate") -> None:
    """One-line :class:`SingleProcessWarning`: ``optimizer`` will train alone, as plain Adam with its schedule.

    ``script`` picks the launch commands the message names: ``"accelerate"`` or ``"trainer"``.
    """
    warnings.warn(
        f"{what}: a single process, so {type(optimizer).__name__} sends nothing and compresses nothing (Adam with "
        f"its schedule); to train on several processes launch with: {_LAUNCH_HINTS[script]}",
        SingleProcessWarning,
        stacklevel=3,
    )
