"""What the planner measures on the local device: compute times, and each step kind's bytes and calls.

Nothing here is a typed-in constant. Forward, backward and the optimizer steps are timed on the
model itself (medians). Each step kind of both optimizers runs in full, with a communicator that
stands in for the cluster's ranks (:meth:`hf_zeroone.comm.Communicator._loopback`): the step
then does all of a rank's compression arithmetic, with local copies in place of the network, and
its :class:`~hf_zeroone.comm.CommStats` count the bytes and collectives a rank of that cluster
sends. PowerSGD's arithmetic is timed as torch's hook runs it, in a one-rank process group.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_zeroone.comm import Communicator
from hf_zeroone.optim import OneBitAdam, StepKind, ZeroOneAdam

__all__ = ["KindCost", "Measurements", "measure", "powersgd_payload", "step_kind_counts"]

#: optimizer -> (class, keywords of a short schedule that reaches each of its step kinds, steps to run)
_SHORT_SCHEDULES = {
    "1-bit Adam": (OneBitAdam, {"freeze_step": 2}, 6),
    "0/1 Adam": (
        ZeroOneAdam,
        {
            "var_freeze_step": 8,
            "var_update_scaler": 1,
            "exact_warmup_steps": 1,
            "local_step_scaler": 2,
            "local_step_clipper": 4,
        },
        20,
    ),  # fmt: skip
}
#: PowerSGD's rank (torch's ``matrix_approximation_rank``) in the projections
POWERSGD_RANK = 4
#: a forward and backward slower than this (a large model on a CPU) is timed once, after the warm-up
SLOW_SECONDS = 5.0
#: a ring allreduce's bytes per element of DDP's two gradient dtypes
GRADIENT_BYTES = {"fp32": 4, "bf16": 2}


@dataclass
class KindCost:
    """One step kind: ``step()``'s median seconds (its compression arithmetic included) and what a rank sends."""

    seconds: float
    bytes_sent: int
    collectives: int
    in_backward: bool  # sent during backward with the DDP hook (may overlap it); else in step()


@dataclass
class Measurements:
    """Everything the projections need, measured on one device for one cluster size."""

    device: str
    world_size: int
    parameters: int
    tensors: int
    buckets: int
    forward: float
    backward: float
    adamw_step: float
    powersgd_seconds: float  # PowerSGD's arithmetic per step, beyond a plain backward
    powersgd_bytes: int  # the payload of its allreduces per step (P and Q factors, uncompressed tensors)
    kinds: dict[str, dict[StepKind, KindCost]] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_backward(model: torch.nn.Module, batch: dict, repeats: int, device: torch.device) -> tuple[float, float]:
    """Median seconds of the forward pass and of the backward pass (gradients zeroed between runs)."""
    forwards, backwards = [], []
    i = 0
    while i <= repeats:
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        loss = model(**batch).loss
        _sync(device)
        middle = time.perf_counter()
        loss.backward()
        _sync(device)
        if i:  # the first run warms up
            forwards.append(middle - start)
            backwards.append(time.perf_counter() - middle)
        elif time.perf_counter() - start > SLOW_SECONDS:
            repeats = 1  # a slow device: one timed run
        i += 1
    return statistics.median(forwards), statistics.median(backwards)


def _random_gradients(params: list[torch.Tensor]) -> Iterator[None]:
    """Set fresh gradients of a typical size on every call (a step with zero gradients does less work)."""
    gen = torch.Generator(device=params[0].device).manual_seed(1)
    base = [torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * 1e-3 for p in params]
    i = 0
    while True:
        for p, g in zip(params, base):
            p.grad = g.mul(1.0 + 0.01 * (i % 7))
        i += 1
        yield


def _timed_steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int,
                 device: torch.device) -> Iterator[float]:  # fmt: skip
    """Take ``steps`` steps on fresh gradients; yield each ``step()``'s seconds (setting the gradients not timed)."""
    grads = _random_gradients(params)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*communicates in step.. because no hf_zeroone DDP hook ran")
        for _ in range(steps):
            next(grads)
            _sync(device)
            start = time.perf_counter()
            opt.step()
            _sync(device)
            yield time.perf_counter() - start


def _kind_costs(cls: type, kwargs: dict, steps: int, params: list[torch.Tensor], world_size: int,
                device: torch.device) -> dict[StepKind, KindCost]:  # fmt: skip
    """Each step kind of ``cls``'s short schedule: median time (the first step of each kind left out) and bytes."""
    comm = Communicator._loopback(world_size, threaded=True)
    opt = cls(params, lr=1e-4, communicator=comm, check_replicas_every=0, **kwargs)
    times: dict[StepKind, list[float]] = {}
    sent: dict[StepKind, tuple[int, int]] = {}
    for elapsed in _timed_steps(opt, params, steps, device):
        kind = opt.last_step_kind
        if kind in sent:  # a kind's first step allocates its state: not timed
            times.setdefault(kind, []).append(elapsed)
        sent[kind] = (opt.last_step_stats.bytes_sent, opt.last_step_stats.collectives)
    comm.close()
    return {
        kind: KindCost(statistics.median(times[kind]), *sent[kind], in_backward=kind.communicates_in_backward)
        for kind in times
    }


def powersgd_payload(params: list[torch.Tensor], rank: int = POWERSGD_RANK) -> int:
    """Bytes of the allreduces of torch's PowerSGD hook per step, as its rule decides what it compresses.

    A tensor of two or more dimensions is a matrix of ``shape[0]`` rows; it is compressed to
    ``rows + cols`` times ``rank`` floats when that is less than half its elements (torch's
    ``min_compression_rate`` of 2). Other tensors are allreduced as they are.
    """
    total = 0
    for p in params:
        rows = p.shape[0] if p.dim() > 1 else 0
        cols = p.numel() // rows if rows else 0
        compressed = (rows + cols) * rank
        total += 4 * (compressed if rows and 2 * compressed < p.numel() else p.numel())
    return total


class _Shapes(torch.nn.Module):
    """Parameters shaped like a model's, with a loss whose gradients are fixed random tensors: backward is cheap."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        gen = torch.Generator(device=params[0].device).manual_seed(2)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(p.detach().clone()) for p in params)
        self.directions = [torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) for p in params]

    def forward(self) -> torch.Tensor:
        return sum((w * d).sum() for w, d in zip(self.weights, self.directions))


def _powersgd_seconds(params: list[torch.Tensor], repeats: int, device: torch.device) -> float:
    """PowerSGD's arithmetic per step, as torch's hook runs it in a one-rank group, beyond DDP's own backward.

    On parameters shaped like the model's, with random gradients (:class:`_Shapes`): the model's
    own forward and backward would be timed twice for a difference that does not depend on them.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # one bucket: torch's hook issues collectives inside future callbacks, which with several
        # buckets on gloo can wait on each other for ever
        cap_mb = 4 * sum(p.numel() for p in params) / 2**20 + 1
        plain, hooked = (DDP(_Shapes(params), bucket_cap_mb=cap_mb) for _ in range(2))
        state = psgd.PowerSGDState(None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2,
                                   use_error_feedback=True, warm_start=True)  # fmt: skip
        hooked.register_comm_hook(state, psgd.powerSGD_hook)
        differences = []
        for i in range(repeats + 3):  # PowerSGD starts at the third backward
            seconds = []
            for ddp in (plain, hooked):
                ddp.zero_grad(set_to_none=True)
                _sync(device)
                start = time.perf_counter()
                ddp().backward()
                _sync(device)
                seconds.append(time.perf_counter() - start)
            if i >= 3:
                differences.append(seconds[1] - seconds[0])
        del plain, hooked, state  # DDP's reducers go before their process group
        gc.collect()
    finally:
        if own_group:
            dist.destroy_process_group()
    return max(0.0, statistics.median(differences))


def measure(model: torch.nn.Module, batch: dict, world_size: int, *, repeats: int = 3,
            progress: Callable[[str], None] | None = None) -> Measurements:  # fmt: skip
    """Measure ``model`` (on its device) for a cluster of ``world_size`` ranks.

    ``batch``: keyword arguments of ``model`` for one device's batch, with labels, so that
    ``model(**batch).loss`` is a scalar. ``progress`` is called with the name of each stage.
    """
    say = progress or (lambda _stage: None)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    device = params[0].device
    say("forward and backward")
    forward, backward = _forward_backward(model, batch, repeats, device)
    say("AdamW step")
    adamw = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda", foreach=device.type != "cuda")
    adamw_step = statistics.median(list(_timed_steps(adamw, params, repeats + 1, device))[1:])
    del adamw
    say("PowerSGD arithmetic")
    powersgd = _powersgd_seconds(params, repeats, device)
    numel = sum(p.numel() for p in params)
    cap = 25 * 2**20 // 4  # DDP's default bucket of 25 MiB of fp32
    out = Measurements(
        device=str(device), world_size=world_size, parameters=numel, tensors=len(params),
        buckets=max(1, -(-numel // cap)), forward=forward, backward=backward, adamw_step=adamw_step,
        powersgd_seconds=powersgd, powersgd_bytes=powersgd_payload(params),
    )  # fmt: skip
    if world_size > 1:
        for name, (cls, kwargs, steps) in _SHORT_SCHEDULES.items():
            say(f"{name}, every step kind")
            out.kinds[name] = _kind_costs(cls, kwargs, steps, params, world_size, device)
    for p in params:
        p.grad = None
    return out


@functools.lru_cache(maxsize=16)
def step_kind_counts(name: str, steps: int, warmup_steps: int) -> dict[StepKind, int]:
    """Steps of each kind that ``name`` (``"1-bit Adam"``, ``"0/1 Adam"``) takes in a run, by its default schedule."""
    cls = _SHORT_SCHEDULES[name][0]
    opt = cls([torch.zeros(1, requires_grad=True)])
    opt.set_run_length(steps, warmup_steps)
    counts: dict[StepKind, int] = {}
    for _ in range(steps):
        kind = opt.next_step_kind()
        counts[kind] = counts.get(kind, 0) + 1
        opt._advance_schedule(kind)
        opt.schedule["step"] += 1
    return counts
