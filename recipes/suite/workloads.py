"""The plain-loop workloads of the suite (``clm``, ``mlm``, ``lsq``) and the loop every row runs.

A row is a *method*: an optimizer and the communication it runs with, built the way a new user
would build it (the learning rate, its schedule and the run length; every other knob is the
package's default at run time unless the spec's ``settings`` names it):

* ``adamw``: ``torch.optim.AdamW`` on plain DDP. DDP's allreduce runs through torch's own
  ``default_hooks.allreduce_hook`` (documented as equivalent to no hook) so that it can be counted.
* ``powersgd``: AdamW on DDP with torch's ``powerSGD_hook`` (``matrix_approximation_rank=4``,
  ``start_powerSGD_iter`` = the LR warm-up, at least 2; other settings torch's defaults).
* ``onebit_adam`` / ``zeroone_adam``: ``OneBitAdam`` / ``ZeroOneAdam`` with
  ``register_zeroone_hook``, told the run length with ``set_run_length(steps, warmup_steps)`` as
  the README shows, and brought in sync with ``synchronize()`` when the loop ends.
* the peers (``diloco``, ``demo``, ``post_local_sgd``): see ``peers.py``.

How bytes and rounds are counted: ``counting.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from suite.counting import HookCounter, Method, Progress, attach_communication, comm_totals, run_summary
from suite.peers import build_peer

OURS = ("onebit_adam", "zeroone_adam")


def make_optimizer(name: str, params, spec: dict) -> torch.optim.Optimizer:  # noqa: ANN001
    """Only the user-level settings, plus the spec's ``settings`` (a frontier point's knobs)."""
    from hf_zeroone import OneBitAdam, ZeroOneAdam

    common = {"lr": spec["lr"], "weight_decay": spec["weight_decay"]}
    if spec.get("betas"):
        common["betas"] = tuple(spec["betas"])
    if spec.get("follow_gradient_scale") is False and name in OURS:
        common["follow_gradient_scale"] = False  # off, asked for on the command line
    settings = dict(spec.get("settings") or {})
    if name in OURS:
        if settings.pop("exact_messages", False):
            settings["communicator"] = exact_messages_communicator()
        opt = (OneBitAdam if name == "onebit_adam" else ZeroOneAdam)(params, **common, **settings)
        opt.set_run_length(spec["steps"], spec["warmup_steps"])  # what the README tells a user
        return opt
    return torch.optim.AdamW(params, **common)


def exact_messages_communicator():  # noqa: ANN201 - an hf_zeroone.comm.Communicator
    """A diagnostic communicator: the 1-bit messages averaged exactly (fp32) instead of compressed.

    Everything else stays as the optimizer runs it (the frozen variance, its scale, clipping, the
    schedule), so a row with ``--settings '{"exact_messages": true}'`` separates what compression
    costs from what the freeze costs. Bytes are counted as fp32 allreduces.
    """
    from hf_zeroone.comm import Communicator

    class ExactMessages(Communicator):
        def compressed_allreduce_async(self, buffer, worker_error, server_error, layout, exact=None):  # noqa: ANN001, ANN202
            if not self.is_distributed:
                return super().compressed_allreduce_async(buffer, worker_error, server_error, layout, exact)
            return self.allreduce_mean_async(buffer, exact).then(lambda fut: fut.value() * layout.mask)

    return ExactMessages()


def build_method(spec: dict, model: torch.nn.Module, world: int) -> Method:
    """AdamW, PowerSGD, 1-bit Adam or 0/1 Adam on DDP (the peers: ``peers.build_peer``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    name = spec["optimizer"]
    if name not in ("adamw", "powersgd", *OURS):
        return build_peer(spec, model, world)
    ddp = DDP(model)
    opt = make_optimizer(name, ddp.parameters(), spec)
    counter = HookCounter(world)
    attach_communication(ddp, name, opt, spec["warmup_steps"], counter)
    finish = opt.synchronize if name in OURS else (lambda: None)
    return Method(ddp, opt, lambda: comm_totals(name, opt, counter), finish=finish)


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
    steps, warmup = spec["steps"], spec["warmup_steps"]
    if spec["workload"] == "lsq":
        model, train_loss, eval_loss = setup_lsq(spec, rank)
    else:
        model, train_loss, eval_loss = setup_lm(spec, rank, world)
    method = build_method(spec, model, world)
    opt = method.optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: linear_schedule(s, warmup, steps))
    curve, progress, start = [], Progress(spec, steps, rank), time.perf_counter()
    with method.context:
        for step in range(1, steps + 1):
            loss = train_loss(method.module)
            loss.backward()
            if spec["max_grad_norm"] > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            sent, rounds = method.totals()
            curve.append([step, loss.item(), sent, rounds])
            progress.update(step, curve[-1][1])
    method.finish()
    wall = time.perf_counter() - start
    progress.close()
    sent, rounds = method.totals()  # the final sync included
    curve[-1][2:] = [sent, rounds]
    tail = curve[-max(1, steps // 10) :]
    return {
        "metric_name": "held-out loss",
        "metric": eval_loss(model),  # rank 0's replica
        "replicas_equal": replicas_equal(model),
        **run_summary(curve, [c[1] for c in tail], sent, rounds, steps, model, wall),
    }


def replicas_equal(model: torch.nn.Module) -> bool:
    """Whether every rank holds bit-identical parameters (checked after the loop, not counted)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))
