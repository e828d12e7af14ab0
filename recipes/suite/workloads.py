"""One suite run (a spec) under torchrun, as ``launch.py`` starts it, and every workload's data and model.

    PYTHONPATH=recipes torchrun --standalone --nproc_per_node N recipes/suite/workloads.py RUN_DIR/spec.json

Every knob the spec's ``settings`` does not name is the package's default. clm, mlm and lsq run in a plain loop,
finetune (which stdlib package a docstring comes from) through ``ZeroOneTrainer``.
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import sys
import sysconfig
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import transformers
from pretrain import PretrainArguments, build_model, file_docstrings
from run_glue import default_model_path
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_zeroone import Communicator, OneBitAdam, OneBitDiLoCo, ZeroOneAdam, ZeroOneTrainer, ZeroOneTrainingArguments
from hf_zeroone.integrations.training_args import schedule_fields
from suite.counting import OURS, HookCounter, Method, attach_communication, comm_totals, progress, run_summary
from suite.peers import build_peer

CLASSES = {"onebit_adam": OneBitAdam, "zeroone_adam": ZeroOneAdam, "onebit_diloco": OneBitDiLoCo}
PACKAGES = ("asyncio", "email", "importlib", "logging", "xml")


class ExactMessages(Communicator):
    """A diagnostic: the 1-bit messages averaged exactly in fp32; everything else as the optimizer runs it."""

    def compressed_allreduce_async(self, buffer, worker_error, server_error, layout, exact=None):  # noqa: ANN001, ANN201
        if not self.is_distributed:
            return super().compressed_allreduce_async(buffer, worker_error, server_error, layout, exact)
        return self.allreduce_mean_async(buffer, exact).then(lambda fut: fut.value() * layout.mask)


def build_method(spec: dict, model: torch.nn.Module, world: int) -> Method:
    """AdamW, PowerSGD, 1-bit Adam or 0/1 Adam on DDP with the user-level settings and the spec's ``settings``."""
    name = spec["optimizer"]
    if name not in ("adamw", "powersgd", *OURS):
        return build_peer(spec, model, world)
    ddp = DDP(model)
    common = {"lr": spec["lr"], "weight_decay": spec["weight_decay"]}
    if spec.get("betas"):
        common["betas"] = tuple(spec["betas"])
    if spec.get("follow_gradient_scale") is False and name in ("onebit_adam", "zeroone_adam"):
        common["follow_gradient_scale"] = False
    settings = dict(spec.get("settings") or {})
    if name in OURS:
        if settings.pop("exact_messages", False):
            settings["communicator"] = ExactMessages()
        opt = CLASSES[name](ddp.parameters(), **common, **settings)
        if name != "onebit_diloco":
            opt.set_run_length(spec["steps"], spec["warmup_steps"])  # what the README tells a user
    else:
        opt = torch.optim.AdamW(ddp.parameters(), **common)
    counter = HookCounter(world)
    attach_communication(ddp, name, opt, spec["warmup_steps"], counter)
    finish = opt.synchronize if name in OURS else (lambda: None)
    return Method(ddp, opt, lambda: comm_totals(name, opt, counter), finish=finish)


def setup_lsq(spec: dict, rank: int) -> tuple:
    """Least squares: y = W x + noise, one linear layer, a fresh minibatch on every rank and step."""
    n_in, n_out = spec["lsq_in"], spec["lsq_out"]
    w_true = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(spec["seed"])) * spec["lsq_weight_std"]

    def lsq_data(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, n_in, generator=gen)
        return x, x @ w_true.T + spec["lsq_noise"] * torch.randn(n, n_out, generator=gen)

    torch.manual_seed(spec["seed"])
    model = torch.nn.Linear(n_in, n_out)
    gen = torch.Generator().manual_seed(spec["seed"] + 1000 + rank)
    held_out = lsq_data(torch.Generator().manual_seed(spec["seed"] + 999), spec["eval_size"])

    def train_loss(ddp: torch.nn.Module) -> torch.Tensor:
        x, y = lsq_data(gen, spec["batch_size"])
        return torch.nn.functional.mse_loss(ddp(x), y)

    def eval_loss(module: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(module(held_out[0]), held_out[1]))

    return model, train_loss, eval_loss


def setup_lm(spec: dict, rank: int, world: int) -> tuple:
    """GPT-2 CLM or BERT MLM from ``pretrain.py``'s model builder, on the suite's token blocks."""
    data, n_eval, objective = Path(spec["data_dir"]), spec["eval_size"], spec["workload"]
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(data / "tokenizer"))
    blocks = torch.load(data / "blocks.pt")
    eval_blocks, shard = blocks[:n_eval], blocks[n_eval:][rank::world]
    sizes = {k: spec[k] for k in ("hidden_size", "num_layers", "num_heads")}
    torch.manual_seed(spec["seed"])
    model = build_model(PretrainArguments(objective=objective, seq_len=blocks.shape[1], **sizes), tokenizer)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=objective == "mlm", mlm_probability=0.15)
    order_gen = torch.Generator().manual_seed(spec["seed"] + 1)  # the same order on every rank and run
    state = {"order": torch.randperm(len(shard), generator=order_gen), "pos": 0}
    torch.manual_seed(spec["seed"] + 100 + rank)  # masks and dropout differ between ranks

    def train_loss(ddp: torch.nn.Module) -> torch.Tensor:
        bs = spec["batch_size"]
        if state["pos"] + bs > len(shard):
            state["order"], state["pos"] = torch.randperm(len(shard), generator=order_gen), 0
        idx = state["order"][state["pos"] : state["pos"] + bs]
        state["pos"] += bs
        return ddp(**collator([{"input_ids": b} for b in shard[idx]])).loss

    def eval_loss(module: torch.nn.Module) -> float:
        rng = torch.get_rng_state()
        torch.manual_seed(spec["seed"] + 12345)  # the same masks for every optimizer
        module.eval()
        with torch.no_grad():
            batches = [eval_blocks[i : i + 32] for i in range(0, n_eval, 32)]
            losses = [float(module(**collator([{"input_ids": b} for b in batch])).loss) for batch in batches]
        module.train()
        torch.set_rng_state(rng)
        return sum(losses) / len(losses)

    return model, train_loss, eval_loss


def run_loop(spec: dict, rank: int, world: int) -> dict:
    """Train one row of a plain-loop workload; rank 0's held-out loss and the run's counts."""
    steps, warmup = spec["steps"], spec["warmup_steps"]
    lsq = spec["workload"] == "lsq"
    model, train_loss, eval_loss = setup_lsq(spec, rank) if lsq else setup_lm(spec, rank, world)
    method = build_method(spec, model, world)
    opt = method.optimizer

    def linear(step: int) -> float:  # warm-up to 1, then decay to 0 (transformers' linear schedule)
        return step / warmup if step < warmup else max(0.0, (steps - step) / max(1, steps - warmup))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear)
    curve, start = [], time.perf_counter()
    with method.context:
        for step in range(1, steps + 1):
            loss = train_loss(method.module)
            loss.backward()
            if spec["max_grad_norm"] > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            curve.append([step, loss.item(), *method.totals()])
            progress(spec, rank, step, steps, curve[-1][1])
    method.finish()
    wall = time.perf_counter() - start
    sent, rounds = method.totals()  # the final sync included
    curve[-1][2:] = [sent, rounds]
    tail = [c[1] for c in curve[-max(1, steps // 10) :]]
    metric = eval_loss(model)  # rank 0's replica
    equal = replicas_equal(model)
    return {"metric_name": "held-out loss", "metric": metric, "replicas_equal": equal,
            **run_summary(curve, tail, sent, rounds, steps, model, wall)}  # fmt: skip


def replicas_equal(model: torch.nn.Module) -> bool:
    """Whether every rank holds bit-identical parameters (checked after the loop, not counted)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def docstring_dataset(
    packages: tuple[str, ...] = PACKAGES, per_class: int = 0, eval_fraction: float = 0.4, seed: int = 0
) -> dict:
    """``{"labels": [...], "train": [[text, label], ...], "eval": [...]}`` from the stdlib's docstrings."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = re.compile(r"\b(" + "|".join(re.escape(p) for p in packages) + r")\b", re.IGNORECASE)
    by_class = []
    for pkg in packages:
        paths = [path for path in sorted((root / pkg).rglob("*.py")) if not {"test", "tests"} & set(path.parts)]
        by_class.append(sorted({" ".join(names.sub(" ", d).split()) for p in paths for d in file_docstrings(p, 60)}))
    smallest = min(len(t) for t in by_class)
    n = smallest if per_class <= 0 else per_class
    if n < 4 or n > smallest:
        counts = dict(zip(packages, map(len, by_class)))
        raise ValueError(f"asked for {n} docstrings per class; this Python's stdlib has {counts}")
    n_eval = max(1, round(n * eval_fraction))
    train, held_out = [], []
    for label, texts in enumerate(by_class):
        random.Random(seed + label).shuffle(texts)
        held_out += [[t, label] for t in texts[:n_eval]]
        train += [[t, label] for t in texts[n_eval:n]]
    random.Random(seed).shuffle(train)
    return {"labels": list(packages), "train": train, "eval": held_out}


def pretrained_classifier(labels: list[str], seed: int) -> torch.nn.Module:
    """MiniLM with a new classification head, initialised from ``seed`` (as ``run_glue.py`` does)."""
    transformers.set_seed(seed)
    ids = dict(enumerate(labels))
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        default_model_path(), num_labels=len(labels), id2label=ids, label2id={name: i for i, name in ids.items()}
    )


def unknown_trainer_settings(settings: dict) -> str | None:
    """What is wrong with ``settings`` for the fine-tuning rows (``ZeroOneTrainingArguments`` fields), or ``None``."""
    unknown = sorted(set(settings) - {f.name for f in fields(ZeroOneTrainingArguments)})
    if unknown:
        return (
            f"--settings {unknown} are not ZeroOneTrainingArguments fields, which the finetune rows take (e.g. "
            "exact_step_dtype, local_step_clipper, exact_warmup_steps); run finetune apart with its own --settings"
        )
    return None


def training_arguments(spec: dict) -> ZeroOneTrainingArguments:
    """Trainer defaults plus the spec's learning rate, epochs, warm-up, seed, optimizer and ``settings``."""
    name = spec["optimizer"]
    settings = dict(spec.get("settings") or {})
    problem = unknown_trainer_settings(settings)
    if problem:
        raise ValueError(problem)
    # --settings go to both compressed rows: each takes its own schedule fields (the arguments refuse the other's)
    others = {f for n in ("onebit_adam", "zeroone_adam") if n != name for f in schedule_fields(n)}
    other = others - set(schedule_fields(name))
    settings = {k: v for k, v in settings.items() if k not in other}
    optim = name if name in ("onebit_adam", "zeroone_adam") else "adamw_torch"
    schedule = dict(learning_rate=spec["lr"], num_train_epochs=spec["epochs"], warmup_steps=spec["warmup_ratio"])
    quiet = dict(report_to="none", save_strategy="no", logging_steps=spec["log_every"], disable_tqdm=True)
    out = str(Path(spec["run_dir"]) / "trainer")  # seed: the head's initialisation and the data order
    return ZeroOneTrainingArguments(
        output_dir=out, optim_compression=optim, seed=spec["seed"], use_cpu=True, **schedule, **quiet, **settings
    )


def run_finetune(spec: dict) -> dict:
    """Train and evaluate under ``torchrun`` (the Trainer joins the process group)."""
    data = json.loads(Path(spec["data_dir"], "docstrings.json").read_text())
    labels, tokenizer = data["labels"], transformers.AutoTokenizer.from_pretrained(default_model_path())

    def encode(rows: list) -> list[dict]:
        enc = tokenizer([t for t, _ in rows], truncation=True, max_length=spec["max_length"])
        pairs = zip(enc["input_ids"], enc["attention_mask"], rows)
        return [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, (_, y) in pairs]

    model, name, args = pretrained_classifier(labels, spec["seed"]), spec["optimizer"], training_arguments(spec)

    def accuracy(pred) -> dict:
        return {"accuracy": float((np.argmax(pred.predictions, axis=-1) == pred.label_ids).mean())}

    datasets = dict(train_dataset=encode(data["train"]), eval_dataset=encode(data["eval"]), processing_class=tokenizer)
    trainer = ZeroOneTrainer(model=model, args=args, compute_metrics=accuracy, **datasets)
    world = dist.get_world_size()
    counter, per_step = HookCounter(world), {}

    class SuiteCallback(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - Trainer's signature
            if name in ("adamw", "powersgd"):
                warmup = args.get_warmup_steps(state.max_steps)
                attach_communication(trainer.model_wrapped, name, None, warmup, counter)

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            per_step[state.global_step] = comm_totals(name, trainer.optimizer, counter)
            losses = [e["loss"] for e in state.log_history if "loss" in e]
            loss = losses[-1] if losses else float("nan")
            progress(spec, dist.get_rank(), state.global_step, state.max_steps, loss)

    trainer.add_callback(SuiteCallback())
    start = time.perf_counter()
    train_out = trainer.train()
    wall = time.perf_counter() - start
    steps = trainer.state.global_step
    sent, rounds = per_step[steps]
    metrics = trainer.evaluate()
    logs = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
    curve = [[e["step"], e["loss"], *per_step[e["step"]]] for e in logs]
    tail = [c[1] for c in curve if c[0] > steps - max(1, steps // 10)] or [curve[-1][1]]
    examples = {"train": len(data["train"]), "eval": len(data["eval"]), "classes": labels}
    return {"metric_name": "accuracy (%)", "metric": 100 * metrics["eval_accuracy"], "eval_loss": metrics["eval_loss"],
            **run_summary(curve, tail, sent, rounds, steps, model, wall),
            "train_runtime": train_out.metrics.get("train_runtime"), "examples": examples}  # fmt: skip


def main() -> None:
    """Run the spec ``sys.argv[1]``; rank 0 writes ``result.json`` into the run's directory."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    if spec["workload"] == "finetune":
        result = run_finetune(spec)  # the Trainer sets up the process group itself
        rank = dist.get_rank() if dist.is_initialized() else 0
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        result = run_loop(spec, rank, dist.get_world_size())
    if rank == 0:
        result.update(workload=spec["workload"], optimizer=spec["optimizer"], world_size=int(os.environ["WORLD_SIZE"]))
        Path(spec["run_dir"], "result.json").write_text(json.dumps(result))
    if dist.is_initialized():
        gc.collect()  # DDP's reference cycles, collected while the process group still exists
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
