"""Counting what each run sends, and the progress each run reports (shared by every suite worker).

Bytes and rounds per rank are counted the same way for every row:

* hf_zeroone counts its own (``opt.comm_stats``: ``bytes_sent``, ``collectives``);
* for torch's DDP hooks (AdamW's plain allreduce, PowerSGD) and for the peers (``peers.py``), the
  module-level ``dist`` of the module that communicates is replaced by a proxy that counts every
  collective it issues: one round each; an allreduce costs the ring formula of hf_zeroone,
  ``2 (P-1)/P x`` the tensor's bytes (the model ``CommStats`` uses), an all-gather ``(P-1)/P x``
  the gathered bytes (each rank sends its own part to the others), a broadcast its bytes.

For AdamW that is one allreduce per DDP bucket per step; for PowerSGD the allreduces of the
uncompressed tensors, of the P matrices and of the Q matrices per bucket (one per bucket before
``start_powerSGD_iter``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Method:
    """What one row trains with: the module to call, the optimizer to step, how to count and finish."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    totals: Callable[[], tuple[int, int]]  # (bytes, rounds) this rank has sent so far
    context: Any = field(default_factory=contextlib.nullcontext)  # entered around the loop
    finish: Callable[[], None] = lambda: None  # after the loop (and its context), before the evaluation


class HookCounter:
    """Counts the collectives a module issues through its module-level ``dist``: rounds and bytes per rank."""

    def __init__(self, world: int) -> None:
        self.world, self.bytes, self.rounds = world, 0, 0

    def add(self, numel: int, element_size: int, op: str = "all_reduce") -> None:
        """One collective of ``numel`` elements (an all-gather: this rank's part), counted per rank."""
        from hf_zeroone.comm import fp32_allreduce_bytes

        self.rounds += 1
        if op == "all_reduce":
            self.bytes += fp32_allreduce_bytes(numel, self.world, element_size)
        elif op == "all_gather":  # this rank's part goes to the P - 1 others
            self.bytes += (self.world - 1) * numel * element_size
        else:  # broadcast: the whole tensor, once
            self.bytes += numel * element_size

    def proxy(self):  # noqa: ANN201 - a stand-in for torch.distributed
        """``torch.distributed`` with its allreduces, all-gathers and broadcasts counted."""
        counter = self

        class CountingDist:
            def __getattr__(self, name):  # everything else is torch.distributed itself
                return getattr(dist, name)

            def all_reduce(self, tensor, *args, **kwargs):
                counter.add(tensor.numel(), tensor.element_size())
                return dist.all_reduce(tensor, *args, **kwargs)

            def all_gather(self, tensors, tensor, *args, **kwargs):
                counter.add(tensor.numel(), tensor.element_size(), "all_gather")
                return dist.all_gather(tensors, tensor, *args, **kwargs)

            def broadcast(self, tensor, *args, **kwargs):
                counter.add(tensor.numel(), tensor.element_size(), "broadcast")
                return dist.broadcast(tensor, *args, **kwargs)

        return CountingDist()

    def install(self, *modules) -> None:  # noqa: ANN002 - modules
        """Count what ``modules`` (default: torch's allreduce and PowerSGD hooks) send through ``dist``."""
        if not modules:
            import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
            import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd

            modules = (default_hooks, powersgd)
        for module in modules:
            module.dist = self.proxy()


def attach_communication(ddp, name: str, opt, start: int, counter: HookCounter) -> None:
    """The DDP communication each optimizer runs with (see the module docstring)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from hf_zeroone.ddp_hook import register_zeroone_hook

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


def one_bucket_at_a_time(hook):
    """``hook`` on a bucket starts only once its previous bucket's future has completed.

    torch's PowerSGD hook issues the P and Q allreduces from future callbacks. With several DDP
    buckets on gloo, those can reach the process group in a different order on different ranks
    (seen here: "Received data size doesn't match expected size" at the first compressed step).
    Waiting for the previous bucket fixes the order; what is computed and sent is unchanged. The
    hook also gets a process group of its own: under the Trainer (``find_unused_parameters=True``)
    the run still failed the same way at the first compressed step, most likely because DDP's own
    allreduce of the used-parameter map interleaved with the P and Q allreduces.
    """
    previous: list = []

    def serial(state, bucket):
        if previous:
            previous.pop().wait()
        fut = hook(state, bucket)
        previous.append(fut)
        return fut

    return serial


def comm_totals(name: str, opt, counter: HookCounter) -> tuple[int, int]:
    if name in ("onebit_adam", "zeroone_adam"):
        from hf_zeroone.integrations.stats import unwrap_optimizer

        stats = unwrap_optimizer(opt).comm_stats
        return stats.bytes_sent, stats.collectives
    return counter.bytes, counter.rounds


class Progress:
    """A tqdm bar on rank 0 plus a one-line progress file the suite polls."""

    def __init__(self, spec: dict, total: int, rank: int) -> None:
        self.path, self.total, self.bar = Path(spec["run_dir"]) / "progress.txt", total, None
        if rank == 0:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"{spec['workload']}/{spec['optimizer']}", mininterval=2.0)

    def update(self, step: int, loss: float) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        if step % 10 == 0 or step == self.total:
            self.bar.set_postfix(loss=f"{loss:.4f}")
            self.path.write_text(f"{step} {self.total} {loss:.6g}\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_summary(
    curve: list[list], tail: list[float], sent: int, rounds: int, steps: int, model: torch.nn.Module, wall: float
) -> dict:
    """The fields every run's result has: the loss curve and its last tenth, bytes, rounds, size, time."""
    return {
        "train_loss_last10pct": sum(tail) / len(tail),
        "first_loss": curve[0][1],
        "curve": curve,
        "bytes": sent,
        "rounds": rounds,
        "steps": steps,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_wall_s": wall,
    }
