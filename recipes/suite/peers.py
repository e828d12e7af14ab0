"""The peers as suite rows: torchft's DiLoCo, DeMo and torch's post-local SGD, each from its own package
(``pip install -e ".[peers]"``) and only counted here."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from suite.counting import HookCounter, Method

#: each peer's settings and their defaults (a frontier point overrides them in ``spec["settings"]``)
PEER_DEFAULTS = {
    "diloco": {"sync_every": 32, "outer_lr": 0.7, "outer_momentum": 0.9},
    "demo": {"compression_top_k": 32, "compression_chunk": 64},
    "post_local_sgd": {"period": 16},
}
PEERS = tuple(PEER_DEFAULTS)


def build_peer(spec: dict, model: torch.nn.Module, world: int) -> Method:
    """The peer ``spec["optimizer"]`` with its defaults and the spec's ``settings``."""
    name = spec["optimizer"]
    if name not in PEERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from adamw, powersgd, onebit_adam, zeroone_adam, "
                         f"{', '.join(PEERS)}")  # fmt: skip
    settings = {**PEER_DEFAULTS[name], **(spec.get("settings") or {})}
    try:
        build = {"diloco": diloco, "demo": demo, "post_local_sgd": post_local_sgd}[name]
        return build(spec, model, world, **settings)
    except ImportError as err:
        raise ImportError(f"{name} needs the peers' packages: pip install -e '.[peers]' ({err})") from err


def inner_adamw(spec: dict, params) -> torch.optim.AdamW:  # noqa: ANN001
    return torch.optim.AdamW(params, lr=spec["lr"], weight_decay=spec["weight_decay"])


def diloco(
    spec: dict, model: torch.nn.Module, world: int, sync_every: int, outer_lr: float, outer_momentum: float
) -> Method:
    """torchft's DiLoCo, every ``Manager.allreduce`` (fp32 pseudo-gradients) counted; quorums are not."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo

    rank, lighthouse, port = dist.get_rank(), None, [None]
    if rank == 0:
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world, join_timeout_ms=60_000)
        port = [int(lighthouse.address().rsplit(":", 1)[1])]
    dist.broadcast_object_list(port, src=0)
    store_alive = [store := dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)]
    inner = inner_adamw(spec, model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    timeout = timedelta(seconds=300)
    # DiLoCo refuses an async quorum; no init_sync: every replica starts from the same seeded model;
    # lighthouse_addr: address() names the machine, not loopback
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world, use_async_quorum=False, init_sync=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"suite_{rank}", rank=0, world_size=1, store_addr="localhost", store_port=store.port,
        lighthouse_addr=f"http://localhost:{port[0]}", hostname="localhost", timeout=timeout, quorum_timeout=timeout,
    )  # fmt: skip
    counter = HookCounter(world)
    manager.allreduce = counter.wrap(manager.allreduce)

    def finish() -> None:  # the store must live until here: the quorum's process groups connect to it
        manager.shutdown(wait=False)
        dist.barrier()
        del store_alive[:]
        if lighthouse is not None:
            lighthouse.shutdown()

    context = DiLoCo(manager, [model], inner, outer, sync_every=sync_every)
    return Method(model, inner, lambda: (counter.bytes, counter.rounds), context=context, finish=finish)


def demo(spec: dict, model: torch.nn.Module, world: int, compression_top_k: int, compression_chunk: int) -> Method:
    """DeMo, its two all-gathers per step counted and checked against its own ``data_transmit``."""
    import pytorch_optimizer.optimizer.demo as demo_module
    from pytorch_optimizer import DeMo

    counter = HookCounter(world)
    demo_module.all_gather = counter.wrap(demo_module.all_gather, "all_gather", 1)
    opt = DeMo(model.parameters(), lr=spec["lr"], compression_top_k=compression_top_k,
               compression_chunk=compression_chunk, weight_decay=spec["weight_decay"])  # fmt: skip
    reported = [0]

    def note_reported(optimizer, args, kwargs) -> None:  # noqa: ANN001
        reported[0] += (world - 1) * optimizer.data_transmit  # data_transmit: this rank's part, this step

    opt.register_step_post_hook(note_reported)

    def totals() -> tuple[int, int]:
        if reported[0] != counter.bytes:
            raise AssertionError(f"DeMo reports {reported[0]} bytes sent, its all-gathers {counter.bytes}")
        return counter.bytes, counter.rounds

    return Method(model, opt, totals)


def post_local_sgd(spec: dict, model: torch.nn.Module, world: int, period: int) -> Method:
    """Post-local SGD: gradients allreduced during the warm-up, parameters averaged every ``period`` steps after."""
    import torch.distributed.algorithms.model_averaging.utils as averaging_utils
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    counter = HookCounter(world)
    counter.install()  # the hook's allreduces before start_localSGD_iter
    counter.install(averaging_utils)  # the averager's
    warmup = max(1, spec["warmup_steps"])
    ddp = DDP(model)
    # post_local_gradient_allreduce=False: the default splits the world with new_subgroups(), which needs CUDA
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup,
                              post_local_gradient_allreduce=False)  # fmt: skip
    ddp.register_comm_hook(state, post_localSGD_hook)
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
    opt = PostLocalSGDOptimizer(optim=inner_adamw(spec, ddp.parameters()), averager=averager)

    def finish() -> None:  # one model to evaluate: the replicas' average, as a user would save it
        last = averager.step - 1  # the averager counts the steps it has seen
        if last < warmup or (last - warmup) % period != 0:  # the last step did not average them
            averaging_utils.average_parameters(iter(model.parameters()), dist.group.WORLD)

    return Method(ddp, opt, lambda: (counter.bytes, counter.rounds), finish=finish)
