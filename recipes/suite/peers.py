"""The peers: local-step and sparse-momentum methods, each from its own package, as a suite row.

Install them with ``pip install -e ".[peers]"`` (torchft, pytorch-optimizer, einops); the rest of
the suite does not need them. Nothing here re-implements a peer: each row builds the package's
own class with the settings its paper or README gives, and only counts what it sends.

* ``diloco``: torchft's ``DiLoCo`` (Douillard et al., arXiv 2311.08105). Inner optimizer: AdamW
  with the suite's settings and LR schedule; outer: ``SGD(lr=outer_lr, momentum=outer_momentum,
  nesterov=True)`` (the paper's, ``outer_lr`` 0.7 and ``outer_momentum`` 0.9 by default); ``sync_every`` = ``H``. Each
  process is a torchft replica group of one, with its own ``TCPStore`` and
  ``torchft.ProcessGroupGloo``; rank 0 runs the lighthouse in-process. Bytes: every
  ``Manager.allreduce`` of the pseudo-gradients, fp32 (``should_quantize`` needs Triton, so the
  quantized path is not taken on CPU), by the ring formula; the lighthouse's quorum messages
  (a few hundred bytes per sync) are not counted.
* ``demo``: ``pytorch_optimizer.DeMo`` (Peng et al., arXiv 2411.19870): sign-SGD on the top-k DCT
  coefficients of each rank's momentum, exchanged with two all-gathers (indices int64, values)
  per step. Bytes: what the all-gathers send, ``(P-1)`` times this rank's part; the row also
  records DeMo's own ``data_transmit`` total to show that the two agree.
* ``post_local_sgd``: torch's post-local SGD (Lin et al., arXiv 1808.07217):
  ``PostLocalSGDOptimizer(AdamW, PeriodicModelAverager(period, warmup_steps=W))`` on DDP with
  ``post_localSGD_hook`` (``start_localSGD_iter=W``, ``post_local_gradient_allreduce=False``:
  the default splits the world with ``new_subgroups()``, which needs CUDA). Gradients are
  allreduced during the LR warm-up, parameters averaged every ``period`` steps after it, and once
  more when the loop ends so that every replica evaluates the same model.

Left out: SparseLoCo (no package), and Accelerate's ``LocalSGD``, which averages the parameters
every ``local_sgd_steps`` steps exactly as ``post_local_sgd`` does after its warm-up.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from suite.counting import HookCounter, Method

PEERS = ("diloco", "demo", "post_local_sgd")
#: each peer's settings and their defaults (a frontier point overrides them in ``spec["settings"]``)
PEER_DEFAULTS = {
    "diloco": {"sync_every": 32, "outer_lr": 0.7, "outer_momentum": 0.9},
    "demo": {"compression_top_k": 32, "compression_chunk": 64},
    "post_local_sgd": {"period": 16},
}


def build_peer(spec: dict, model: torch.nn.Module, world: int) -> Method:
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
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo

    rank, lighthouse, port = dist.get_rank(), None, [None]
    if rank == 0:
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world, join_timeout_ms=60_000)
        port = [int(lighthouse.address().rsplit(":", 1)[1])]
    dist.broadcast_object_list(port, src=0)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    store_alive = [store]
    inner = inner_adamw(spec, model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=300)),
        min_replica_size=world,
        use_async_quorum=False,  # DiLoCo refuses anything else
        init_sync=False,  # every replica starts from the same seeded model
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"suite_{rank}",
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=f"http://localhost:{port[0]}",  # address() names the machine, not loopback
        hostname="localhost",
        timeout=timedelta(seconds=300),
        quorum_timeout=timedelta(seconds=300),
    )
    counter = HookCounter(world)
    allreduce = manager.allreduce

    def counted_allreduce(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        counter.add(tensor.numel(), tensor.element_size())
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = counted_allreduce

    def finish() -> None:  # the store must live until here: the quorum's process groups connect to it
        manager.shutdown(wait=False)
        dist.barrier()
        del store_alive[:]
        if lighthouse is not None:
            lighthouse.shutdown()

    context = DiLoCo(manager, [model], inner, outer, sync_every=sync_every)
    return Method(model, inner, lambda: (counter.bytes, counter.rounds), context=context, finish=finish)


def demo(spec: dict, model: torch.nn.Module, world: int, compression_top_k: int, compression_chunk: int) -> Method:
    import pytorch_optimizer.optimizer.demo as demo_module
    from pytorch_optimizer import DeMo

    counter = HookCounter(world)
    all_gather = demo_module.all_gather

    def counted_all_gather(tensors, tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        counter.add(tensor.numel(), tensor.element_size(), "all_gather")
        return all_gather(tensors, tensor, *args, **kwargs)

    demo_module.all_gather = counted_all_gather
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
