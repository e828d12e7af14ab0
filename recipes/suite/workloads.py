"""One run of the convergence suite (``recipes/convergence.py``): one workload, one optimizer.

Started by the suite under ``torchrun --standalone --nproc_per_node N`` with the path of a JSON
spec the suite wrote (``python recipes/convergence_worker.py RUN_DIR/spec.json``); rank 0 writes
``RUN_DIR/result.json``. Not meant to be run by hand, but it can be, with such a spec.

Optimizers, each built the way a new user would build it (only the learning rate, its schedule,
the run length, ``freeze_step`` / ``var_freeze_step`` and, for 0/1 Adam on the language models, its
local-step schedule as the README recommends; everything else is the package's
default at run time):

* ``adamw``: ``torch.optim.AdamW`` on plain DDP. DDP's allreduce runs through torch's own
  ``default_hooks.allreduce_hook`` (documented as equivalent to no hook) so that every bucket
  allreduce can be counted.
* ``powersgd``: AdamW on DDP with torch's ``powerSGD_hook`` (``matrix_approximation_rank=4``,
  ``start_powerSGD_iter`` = ``freeze_step``, at least 2; other settings torch's defaults), on a
  process group of its own, one bucket at a time (:func:`one_bucket_at_a_time`).
* ``onebit_adam`` / ``zeroone_adam``: ``OneBitAdam`` / ``ZeroOneAdam`` with
  ``register_zeroone_hook`` (the plain-loop path), or ``ZeroOneTrainer`` on ``finetune``.

Bytes and rounds per rank: hf_zeroone counts its own (``opt.comm_stats``: ``bytes_sent``,
``collectives``). For the two torch hooks, the module-level ``dist`` of torch's hook modules is
replaced by a proxy that counts every ``all_reduce`` they issue (one round each; bytes by the
fp32 ring formula of hf_zeroone, ``2 (P-1)/P x`` the tensor's bytes, the model ``CommStats``
uses): for AdamW one allreduce per DDP bucket per step, for PowerSGD the allreduces of the
uncompressed tensors, of the P matrices and of the Q matrices per bucket (one per bucket before
``start_powerSGD_iter``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


class HookCounter:
    """Counts the allreduces torch's DDP hooks issue: rounds and ring-allreduce bytes per rank."""

    def __init__(self, world: int) -> None:
        self.world, self.bytes, self.rounds = world, 0, 0

    def install(self) -> None:
        import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
        import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd

        from hf_zeroone.comm import fp32_allreduce_bytes

        counter = self

        class CountingDist:
            def __getattr__(self, name):  # everything but all_reduce is torch.distributed itself
                return getattr(dist, name)

            def all_reduce(self, tensor, *args, **kwargs):
                counter.rounds += 1
                counter.bytes += fp32_allreduce_bytes(tensor.numel(), counter.world, tensor.element_size())
                return dist.all_reduce(tensor, *args, **kwargs)

        default_hooks.dist = CountingDist()
        powersgd.dist = CountingDist()


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


def make_optimizer(name: str, params, spec: dict):
    """Only the user-level settings; the rest is whatever the optimizer's defaults are today."""
    from hf_zeroone import OneBitAdam, ZeroOneAdam

    common = {"lr": spec["lr"], "weight_decay": spec["weight_decay"]}
    if spec.get("betas"):
        common["betas"] = tuple(spec["betas"])
    if spec.get("follow_gradient_scale") is False and name in ("onebit_adam", "zeroone_adam"):
        common["follow_gradient_scale"] = False  # off, asked for on the command line
    if name == "onebit_adam":
        return OneBitAdam(params, freeze_step=spec["freeze_step"], **common)
    if name == "zeroone_adam":
        local = {k: spec[k] for k in ("local_step_scaler", "local_step_clipper") if k in spec}
        return ZeroOneAdam(params, var_freeze_step=spec["freeze_step"], **local, **common)
    return torch.optim.AdamW(params, **common)


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


# ------------------------------------------------------------------------------ plain loops
def lsq_data(spec: dict, gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch_w = torch.Generator().manual_seed(spec["seed"])
    w_true = torch.randn(spec["lsq_out"], spec["lsq_in"], generator=torch_w) * spec["lsq_weight_std"]
    x = torch.randn(n, spec["lsq_in"], generator=gen)
    return x, x @ w_true.T + spec["lsq_noise"] * torch.randn(n, spec["lsq_out"], generator=gen)


def setup_lsq(spec: dict, rank: int):
    """Least squares: y = W x + noise, one linear layer, a fresh minibatch on every rank and step."""
    torch.manual_seed(spec["seed"])
    model = torch.nn.Linear(spec["lsq_in"], spec["lsq_out"])
    gen = torch.Generator().manual_seed(spec["seed"] + 1000 + rank)
    held_out = lsq_data(spec, torch.Generator().manual_seed(spec["seed"] + 999), spec["eval_size"])

    def train_loss(ddp) -> torch.Tensor:
        x, y = lsq_data(spec, gen, spec["batch_size"])
        return torch.nn.functional.mse_loss(ddp(x), y)

    def eval_loss(module) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(module(held_out[0]), held_out[1]))

    return model, train_loss, eval_loss


def setup_lm(spec: dict, rank: int, world: int):
    """GPT-2 CLM or BERT MLM from ``pretrain.py``'s model builder, on the suite's token blocks."""
    sys.path.insert(0, str(HERE))
    from pretrain import PretrainArguments, build_model
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    data = Path(spec["data_dir"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(data / "tokenizer"))
    blocks = torch.load(data / "blocks.pt")
    n_eval = spec["eval_size"]
    eval_blocks, train_blocks = blocks[:n_eval], blocks[n_eval:]
    objective = spec["workload"]
    margs = PretrainArguments(
        objective=objective,
        hidden_size=spec["hidden_size"],
        num_layers=spec["num_layers"],
        num_heads=spec["num_heads"],
        seq_len=blocks.shape[1],
    )
    torch.manual_seed(spec["seed"])
    model = build_model(margs, tokenizer)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=objective == "mlm", mlm_probability=0.15)
    shard = train_blocks[rank::world]
    order_gen = torch.Generator().manual_seed(spec["seed"] + 1)  # the same order on every rank and run
    state = {"order": torch.randperm(len(shard), generator=order_gen), "pos": 0}
    torch.manual_seed(spec["seed"] + 100 + rank)  # masks and dropout differ between ranks

    def train_loss(ddp) -> torch.Tensor:
        bs = spec["batch_size"]
        if state["pos"] + bs > len(shard):
            state["order"], state["pos"] = torch.randperm(len(shard), generator=order_gen), 0
        idx = state["order"][state["pos"] : state["pos"] + bs]
        state["pos"] += bs
        return ddp(**collator([{"input_ids": b} for b in shard[idx]])).loss

    def eval_loss(module) -> float:
        rng = torch.get_rng_state()
        torch.manual_seed(spec["seed"] + 12345)  # the same masks for every optimizer
        module.eval()
        with torch.no_grad():
            losses = [
                float(module(**collator([{"input_ids": b} for b in eval_blocks[i : i + 32]])).loss)
                for i in range(0, n_eval, 32)
            ]
        module.train()
        torch.set_rng_state(rng)
        return sum(losses) / len(losses)

    return model, train_loss, eval_loss


def linear_schedule(step: int, warmup: int, total: int) -> float:
    """LR factor: linear warm-up to 1, then linear decay to 0 (transformers' linear schedule)."""
    if step < warmup:
        return step / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def run_loop(spec: dict, rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    name, steps, warmup = spec["optimizer"], spec["steps"], spec["warmup_steps"]
    if spec["workload"] == "lsq":
        model, train_loss, eval_loss = setup_lsq(spec, rank)
    else:
        model, train_loss, eval_loss = setup_lm(spec, rank, world)
    ddp = DDP(model)
    opt = make_optimizer(name, ddp.parameters(), spec)
    counter = HookCounter(world)
    attach_communication(ddp, name, opt, spec["freeze_step"], counter)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: linear_schedule(s, warmup, steps))
    curve, progress, start = [], Progress(spec, steps, rank), time.perf_counter()
    for step in range(1, steps + 1):
        loss = train_loss(ddp)
        loss.backward()
        if spec["max_grad_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), spec["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        sent, rounds = comm_totals(name, opt, counter)
        curve.append([step, loss.item(), sent, rounds])
        progress.update(step, curve[-1][1])
    wall = time.perf_counter() - start
    progress.close()
    tail = curve[-max(1, steps // 10) :]
    return {
        "metric_name": "held-out loss",
        "metric": eval_loss(model),  # rank 0's replica
        "train_loss_last10pct": sum(c[1] for c in tail) / len(tail),
        "first_loss": curve[0][1],
        "curve": curve,
        "bytes": curve[-1][2],
        "rounds": curve[-1][3],
        "steps": steps,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_wall_s": wall,
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    if spec["workload"] == "finetune":
        from convergence_finetune import run_finetune

        result = run_finetune(spec)  # the Trainer sets up the process group itself
        rank = dist.get_rank() if dist.is_initialized() else 0
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        result = run_loop(spec, rank, world)
    if rank == 0:
        result.update(workload=spec["workload"], optimizer=spec["optimizer"], world_size=int(os.environ["WORLD_SIZE"]))
        Path(spec["run_dir"], "result.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
