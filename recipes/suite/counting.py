"""Bytes and rounds per rank of every suite run: hf_zeroone's own ``comm_stats``, else every collective counted
(one round each; an allreduce ``2 (P-1)/P x`` its bytes, an all-gather ``(P-1) x`` this rank's part)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from hf_zeroone.comm import fp32_allreduce_bytes
from hf_zeroone.ddp_hook import register_zeroone_hook
from hf_zeroone.integrations.stats import unwrap_optimizer

OURS = ("onebit_adam", "zeroone_adam", "onebit_diloco")


@dataclass
class Method:
    """What one row trains with: the module to call, the optimizer to step, how to count and finish."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    totals: Callable[[], tuple[int, int]]  # (bytes, rounds) this rank has sent so far
    context: Any = field(default_factory=contextlib.nullcontext)  # entered around the loop
    finish: Callable[[], None] = lambda: None  # after the loop (and its context), before the evaluation


class HookCounter:
    """Rounds and bytes per rank of the collectives it is told about."""

    def __init__(self, world: int) -> None:
        self.world, self.bytes, self.rounds = world, 0, 0

    def add(self, numel: int, element_size: int, op: str = "all_reduce") -> None:
        """One collective of ``numel`` elements (an all-gather: this rank's part)."""
        self.rounds += 1
        if op == "all_reduce":
            self.bytes += fp32_allreduce_bytes(numel, self.world, element_size)
        else:  # all-gather: this rank's part to the P - 1 others; broadcast: the whole tensor once
            self.bytes += (self.world - 1 if op == "all_gather" else 1) * numel * element_size

    def wrap(self, fn: Callable, op: str = "all_reduce", pos: int = 0) -> Callable:
        """``fn`` with the tensor it gets as positional argument ``pos`` counted."""

        def counted(*args, **kwargs):
            self.add(args[pos].numel(), args[pos].element_size(), op)
            return fn(*args, **kwargs)

        return counted

    def install(self, *modules) -> None:  # noqa: ANN002 - modules
        """Count what ``modules`` (default: torch's allreduce and PowerSGD hooks) send through ``dist``."""

        class CountingDist:  # torch.distributed, with the collectives set below counted
            def __getattr__(self, name: str) -> Any:  # noqa: ANN401
                return getattr(dist, name)

        proxy = CountingDist()
        for op, pos in (("all_reduce", 0), ("all_gather", 1), ("broadcast", 0)):
            setattr(proxy, op, self.wrap(getattr(dist, op), op, pos))
        for module in modules or (default_hooks, powerSGD_hook):
            module.dist = proxy


def attach_communication(ddp, name: str, opt, start: int, counter: HookCounter) -> None:  # noqa: ANN001
    """AdamW: torch's allreduce hook; PowerSGD: rank 4 from ``start``; hf_zeroone: its own hook."""
    if name in ("adamw", "powersgd"):
        counter.install()
    if name == "adamw":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=dist.new_group(), matrix_approximation_rank=4, start_powerSGD_iter=max(2, start)
        )
        ddp.register_comm_hook(state, one_bucket_at_a_time(powerSGD_hook.powerSGD_hook))
    else:
        register_zeroone_hook(ddp, opt)


def one_bucket_at_a_time(hook: Callable) -> Callable:
    """``hook`` on a bucket starts once the previous bucket's future is done: PowerSGD's P and Q allreduces, issued
    from future callbacks, then reach gloo in the same order on every rank (with a process group of their own)."""
    previous: list = []

    def serial(state, bucket):
        if previous:
            previous.pop().wait()
        previous.append(hook(state, bucket))
        return previous[-1]

    return serial


def comm_totals(name: str, opt, counter: HookCounter) -> tuple[int, int]:  # noqa: ANN001
    """(bytes, rounds) this rank has sent: hf_zeroone's own count, else ``counter``'s."""
    if name in OURS:
        stats = unwrap_optimizer(opt).comm_stats
        return stats.bytes_sent, stats.collectives
    return counter.bytes, counter.rounds


def progress(spec: dict, rank: int, step: int, total: int, loss: float) -> None:
    """Rank 0, every 10th and the last step: ``step total loss`` into the file the suite polls."""
    if rank == 0 and (step % 10 == 0 or step == total):
        Path(spec["run_dir"], "progress.txt").write_text(f"{step} {total} {loss:.6g}\n")


def run_summary(
    curve: list[list], tail: list[float], sent: int, rounds: int, steps: int, model: torch.nn.Module, wall: float
) -> dict:
    """The fields every run's result has: the loss curve and its last tenth, bytes, rounds, size, time."""
    return {"train_loss_last10pct": sum(tail) / len(tail), "first_loss": curve[0][1], "curve": curve, "bytes": sent,
            "rounds": rounds, "steps": steps, "parameters": sum(p.numel() for p in model.parameters()),
            "train_wall_s": wall}  # fmt: skip
