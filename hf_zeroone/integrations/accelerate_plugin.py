"""Accelerate plugin: the compressed optimizer and DDP hook in a custom ``accelerate launch`` script.

Three added lines in a usual Accelerate training script (``run_clm_no_trainer.py`` and the like)::

    from hf_zeroone import ZeroOneAdam
    from hf_zeroone.integrations import prepare_zeroone

    accelerator = Accelerator()
    optimizer = ZeroOneAdam(model.parameters(), lr=1e-4)                            # 1
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    prepare_zeroone(accelerator, model, optimizer,                                  # 2
                    num_training_steps=max_train_steps, num_warmup_steps=num_warmup_steps)
    for batch in loader:
        ...
        accelerator.backward(loss); optimizer.step(); scheduler.step(); optimizer.zero_grad()
    optimizer.optimizer.synchronize()   # 3: one model on every rank before evaluating or saving

``num_training_steps`` and ``num_warmup_steps`` are optimizer steps, as the script computes them
*before* it multiplies them by the number of processes for Accelerate's scheduler: the optimizer
derives the schedule settings left unset from them (:meth:`~hf_zeroone.optim.CompressedAdamBase.set_run_length`).
0/1 Adam's replicas differ between the syncs of its local phase: ``synchronize()`` after the loop
makes them one model (``accelerator.save_state`` syncs them itself).

``prepare_zeroone`` registers :func:`hf_zeroone.ddp_hook.zeroone_hook` on the model Accelerate
wrapped in ``DistributedDataParallel``. (Accelerate matches ``kwargs_handlers`` by exact class,
so a ``DistributedDataParallelKwargs`` subclass cannot carry a custom hook; registering on the
prepared model is the supported way.) It refuses setups where a DDP hook cannot work: FSDP,
DeepSpeed, Megatron, and a multi-process launch that did not form one process group.

CPU launch that works (two processes)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 train.py
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from hf_zeroone.ddp_hook import ZeroOneHookState, register_zeroone_hook
from hf_zeroone.integrations.checkpoints import read_rank_state, save_rank_state
from hf_zeroone.integrations.launch import CPU_LAUNCH_HELP, check_distributed_launch, warn_single_process
from hf_zeroone.integrations.stats import unwrap_optimizer
from hf_zeroone.optim import HF_ZEROONE_OPTIMIZERS, CompressedAdamBase

_UNSUPPORTED = {
    "FSDP": "FSDP shards gradients with reduce-scatter; there is no DDP allreduce to replace",
    "DEEPSPEED": "DeepSpeed's engine does its own communication; use DeepSpeed's OneBitAdam/ZeroOneAdam there",
    "MEGATRON_LM": "Megatron-LM does its own gradient reduction",
    "XLA": "XLA devices are not supported by the hf_zeroone hook",
}


def prepare_zeroone(
    accelerator: Any,
    model: Any,
    optimizer: Any,
    *,
    num_training_steps: int | None = None,
    num_warmup_steps: int = 0,
) -> ZeroOneHookState | None:
    """Install the hf_zeroone communication hook on an Accelerate-prepared DDP model.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the model returned by ``accelerator.prepare`` (DDP-wrapped when distributed).
        optimizer: the prepared optimizer (an ``AcceleratedOptimizer`` around a hf_zeroone one).
        num_training_steps: the run's optimizer steps; the optimizer derives the schedule settings
            it was not given from them (``set_run_length``). Without it, and without a freeze step
            given to the optimizer, the first step warns that compression would start at step 100000.
        num_warmup_steps: the LR warm-up, in optimizer steps (not multiplied by the number of
            processes, as scripts do for Accelerate's scheduler).

    Returns:
        The hook state, or ``None`` for :class:`~hf_zeroone.OneBitDiLoCo` (its hook has none) and in a single
        process (nothing to communicate; a
        :class:`~hf_zeroone.integrations.launch.SingleProcessWarning` says so and names the
        launch commands that start several processes).

    Raises:
        ValueError: FSDP / DeepSpeed / Megatron setups, or an optimizer that is not hf_zeroone's.
        RuntimeError: several processes that did not form one data-parallel group.
    """
    dtype = getattr(getattr(accelerator, "distributed_type", None), "name", str(accelerator.distributed_type))
    if dtype in _UNSUPPORTED:
        raise ValueError(f"prepare_zeroone: {_UNSUPPORTED[dtype]} (distributed_type={dtype}); use DDP instead")
    opt = unwrap_optimizer(optimizer)
    if not isinstance(opt, HF_ZEROONE_OPTIMIZERS):
        raise ValueError(
            "prepare_zeroone needs a hf_zeroone optimizer (OneBitAdam, ZeroOneAdam, OneBitDiLoCo), "
            f"got {type(opt).__name__}"
        )
    if num_training_steps is not None and isinstance(opt, CompressedAdamBase):
        opt.set_run_length(num_training_steps, num_warmup_steps)
    world = check_distributed_launch("prepare_zeroone")
    if accelerator.num_processes == 1 and world == 1:
        warn_single_process("prepare_zeroone", opt, "accelerate")
        return None
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(
            f"prepare_zeroone: expected the model returned by accelerator.prepare to be "
            f"DistributedDataParallel, got {type(model).__name__} (distributed_type={dtype}).\n" + CPU_LAUNCH_HELP
        )
    state = register_zeroone_hook(model, opt, grad_scaler=getattr(accelerator, "scaler", None))
    if state is not None:
        state.overflow_check_on_local_steps = accelerator.mixed_precision == "fp16"
    _keep_every_rank_state(accelerator, opt)
    return state


def _keep_every_rank_state(accelerator: Any, opt: Any) -> None:
    """Make ``accelerator.save_state`` / ``load_state`` keep each rank's optimizer state.

    ``save_state`` writes rank 0's optimizer state only, and ``load_state`` gives it to every rank,
    whose error buffers would then be reset. Each rank also writes its own file, and on
    ``load_state`` each rank loads its own file in place of rank 0's state. Between two syncs of
    0/1 Adam's local phase, ``save_state`` syncs the replicas first (every rank calls it), so the
    saved model is the one every rank holds.
    """
    if not hasattr(accelerator, "register_save_state_pre_hook"):
        return

    def save(models: Any, weights: Any, output_dir: str) -> None:
        opt.synchronize()
        save_rank_state(opt, output_dir)

    def load(models: Any, input_dir: str) -> None:
        state = read_rank_state(opt, input_dir)
        if state is not None:
            opt.defer_rank_state(state)

    for handle in getattr(accelerator, "_hf_zeroone_state_hooks", ()):  # one hf_zeroone optimizer at a time
        handle.remove()
    accelerator._hf_zeroone_state_hooks = (
        accelerator.register_save_state_pre_hook(save),
        accelerator.register_load_state_pre_hook(load),
    )
