#!/usr/bin/env python
"""Convergence suite: AdamW, PowerSGD, 1-bit Adam and 0/1 Adam with default settings, four workloads.

One command, offline, CPU (gloo), about 100 minutes on two cores::

    python recipes/convergence.py --output_dir outputs/convergence

Workloads (``--workloads``, comma-separated):

* ``finetune``: the offline all-MiniLM-L6-v2 fine-tuned by ``ZeroOneTrainer`` (Trainer defaults
  plus lr, epochs, warm-up) to tell which stdlib package a docstring comes from (5 classes, real
  text; see ``convergence_finetune.py``); metric: held-out accuracy. 2 ranks. One run per optimizer
  and seed of ``--finetune_seeds`` (0,1,2): a single seed's accuracy scatters about 2 points either
  way around AdamW's, so the row is the mean over the seeds and its goal is decided on the mean of
  the paired differences (every optimizer of one seed starts from the same model and data).
* ``clm``: GPT-2-style causal LM pre-training, ``mlm``: BERT-style masked LM pre-training, on the
  embedded corpus and BPE tokenizer of ``pretrain.py`` (stdlib docstrings); metric: held-out
  loss (fixed sequences and masks). 2 ranks.
* ``clm_lengths``: the run-length sweep, ``clm`` at each of ``--clm_lengths`` (200, 400, 800 steps)
  on each of ``--length_seeds`` (0-3); rows ``clm_200``, ``clm_400``, ... Goal: every single run
  within +2% of AdamW's run of the same seed.
* ``lsq``: least squares, ``y = W x + noise`` (128 Gaussian inputs, 32 outputs, weights of std 1,
  noise std 0.1: floor 0.01) with one linear layer, 3 ranks, batch 16, lr 1e-2 decaying linearly
  to 0, betas (0.9, 0.99), 640 steps, freeze at step 200. The loss, and with it the gradient's
  scale, keeps falling long after the freeze: a frozen variance goes stale. Metric: held-out mean
  squared error.

Optimizers (``--optimizers``) get only user-level settings: lr and its schedule, and the run
length with ``optimizer.set_run_length(T, W)`` as the README shows (``lsq``: the freeze at step
200), and the same weight decay (0 by default) and gradient clipping for all; every other knob is
the package's default at run time. PowerSGD is torch's hook at rank 4 with AdamW. What each row
runs: ``suite/workloads.py``; how bytes and rounds are counted: ``suite/counting.py``.

Every workload runs once per optimizer and seed (``--seeds``, default 0, for clm, mlm and lsq).
Writes ``results.md`` (table, goals, seed-by-seed tables), ``results.json``, ``<workload>.png``
(loss curves) and ``runs/<workload>/seed<S>/<optimizer>/run.log`` (each run is a ``torchrun
--standalone`` subprocess of ``suite/worker.py``) into ``--output_dir``. A run whose directory
already holds the result of the same spec is not run again (``--rerun`` forces it). ``--quick``
shrinks everything (smoke test; one seed, one length).
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from suite.launch import code_version, package_defaults, run  # noqa: E402 - needs the path
from suite.report import OPTIMIZERS, markdown, mean_over_seeds, plot  # noqa: E402

WORKLOADS = ("finetune", "clm", "mlm", "lsq", "clm_lengths")


@dataclass
class SuiteArguments:
    output_dir: str = field(default="outputs/convergence", metadata={"help": "Results, plots, run logs, data."})
    workloads: str = field(default=",".join(WORKLOADS), metadata={"help": f"Comma-separated: {', '.join(WORKLOADS)}."})
    optimizers: str = field(
        default=",".join(OPTIMIZERS), metadata={"help": f"Comma-separated: {', '.join(OPTIMIZERS)}."}
    )
    quick: bool = field(default=False, metadata={"help": "Tiny sizes everywhere (smoke test, seconds per run)."})
    report_only: bool = field(default=False, metadata={"help": "Only rewrite results.md and plots from results.json."})
    nproc: int = field(default=2, metadata={"help": "Ranks for finetune, clm and mlm."})
    lsq_nproc: int = field(default=3, metadata={"help": "Ranks for lsq."})
    timeout: int = field(default=1800, metadata={"help": "Seconds one run may take before it is killed."})
    rerun: bool = field(default=False, metadata={"help": "Run again the runs whose results are on disk."})
    seeds: str = field(
        default="0", metadata={"help": "clm, mlm, lsq: comma-separated seeds (initialisation, data order, masks)."}
    )
    finetune_seeds: str = field(
        default="0,1,2",
        metadata={
            "help": "Comma-separated seeds for finetune, one run per optimizer and seed (each seed its own "
            "split, head and data order; every optimizer of a seed starts from the same model and data). Its "
            "row is the mean over the seeds and its goal is decided on the mean of the paired differences."
        },
    )
    follow_gradient_scale: bool = field(
        default=True,
        metadata={
            "help": "False: build 1-bit and 0/1 Adam with follow_gradient_scale=False (the package default is "
            "True) on clm, mlm and lsq; finetune runs through ZeroOneTrainer, which keeps the default."
        },
    )
    settings: str = field(
        default="",
        metadata={
            "help": "A JSON object of keyword arguments for 1-bit and 0/1 Adam on clm, mlm and lsq, and of "
            "ZeroOneTrainingArguments fields on finetune (a diagnostic: the suite's goals are about the defaults), "
            'e.g. \'{"clip_to_variance": false}\' or \'{"exact_step_dtype": "float8_e4m3fn"}\'. '
            "'{\"exact_messages\": true}' averages their 1-bit messages exactly in fp32 instead (the variance "
            "still frozen): what compression costs apart from the freeze. Use its own --output_dir."
        },
    )
    clm_lengths: str = field(default="200,400,800", metadata={"help": "clm_lengths: comma-separated run lengths."})
    length_seeds: str = field(default="0,1,2,3", metadata={"help": "clm_lengths: comma-separated seeds."})
    weight_decay: float = field(default=0.0, metadata={"help": "Decoupled weight decay, the same for every optimizer."})
    # language models
    clm_steps: int = field(default=1000, metadata={"help": "CLM optimizer steps."})
    mlm_steps: int = field(default=500, metadata={"help": "MLM optimizer steps."})
    lm_lr: float = field(default=1e-3, metadata={"help": "LM peak learning rate (linear warm-up, then linear to 0)."})
    lm_warmup_ratio: float = field(
        default=0.1,
        metadata={
            "help": "LM warm-up W (T steps), told to 1-bit and 0/1 Adam with set_run_length(T, W); PowerSGD "
            "starts compressing at W."
        },
    )
    lm_batch_size: int = field(default=8, metadata={"help": "LM sequences per rank and step."})
    lm_seq_len: int = field(default=64, metadata={"help": "LM tokens per sequence."})
    lm_hidden_size: int = field(default=128, metadata={"help": "LM width."})
    lm_num_layers: int = field(default=2, metadata={"help": "LM transformer layers."})
    lm_num_heads: int = field(default=2, metadata={"help": "LM attention heads."})
    lm_max_grad_norm: float = field(default=1.0, metadata={"help": "LM gradient clipping as pretrain.py (0: off)."})
    lm_eval_sequences: int = field(default=128, metadata={"help": "Held-out sequences for the LM metric."})
    corpus_chars: int = field(default=3_000_000, metadata={"help": "Size of the embedded docstring corpus."})
    vocab_size: int = field(default=4096, metadata={"help": "BPE vocabulary trained on the corpus."})
    # fine-tuning
    finetune_lr: float = field(default=1e-4, metadata={"help": "Fine-tuning learning rate."})
    finetune_epochs: float = field(default=3.0, metadata={"help": "Fine-tuning epochs (Trainer default)."})
    finetune_warmup_ratio: float = field(default=0.1, metadata={"help": "Fine-tuning warm-up (fraction of steps)."})
    finetune_per_class: int = field(default=0, metadata={"help": "Docstrings per class (0: all the smallest has)."})
    finetune_eval_fraction: float = field(default=0.4, metadata={"help": "Held-out share of each class."})
    finetune_max_length: int = field(default=64, metadata={"help": "Tokens per docstring (truncated)."})
    # least squares
    lsq_steps: int = field(default=640, metadata={"help": "Least-squares steps."})
    lsq_freeze_step: int = field(default=200, metadata={"help": "Least squares: freeze_step / var_freeze_step."})
    lsq_lr: float = field(default=1e-2, metadata={"help": "Least squares: lr, decaying linearly to 0."})
    lsq_batch_size: int = field(default=16, metadata={"help": "Least squares: samples per rank and step."})
    lsq_noise: float = field(default=0.1, metadata={"help": "Least squares: label noise std (floor: its square)."})
    lsq_weight_std: float = field(
        default=1.0,
        metadata={
            "help": "Least squares: std of the true weights. 1: outputs of variance 128, so the loss (and the "
            "gradient's scale) falls by two orders of magnitude after the freeze; 1/sqrt(128) is an easy problem."
        },
    )

    def __post_init__(self) -> None:
        for name, allowed in (("workloads", WORKLOADS), ("optimizers", OPTIMIZERS)):
            items = [s.strip() for s in getattr(self, name).split(",") if s.strip()]
            bad = sorted(set(items) - set(allowed))
            if bad or not items:
                raise ValueError(f"--{name}: unknown {bad or 'empty list'}; choose from {', '.join(allowed)}")
            setattr(self, name, ",".join(items))
        for name in ("finetune_seeds", "seeds", "length_seeds", "clm_lengths"):
            setattr(self, name, ",".join(map(str, int_list(name, getattr(self, name)))))
        if self.quick:
            defaults = {f.name: f.default for f in fields(self)}
            for key, value in QUICK.items():
                if getattr(self, key) == defaults[key]:
                    setattr(self, key, value)


def int_list(name: str, text: str) -> list[int]:
    """``"0,1,2"`` as distinct integers, or a ``ValueError`` naming the option."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or len(set(values)) != len(values) or min(values) < 0:
        raise ValueError(f"--{name}: want distinct integers >= 0 such as 0,1,2, got {text!r}")
    return values


QUICK = dict(clm_steps=24, mlm_steps=24, clm_lengths="24", length_seeds="0", lm_batch_size=4, lm_seq_len=32,
             lm_hidden_size=32, lm_eval_sequences=16,
             corpus_chars=150_000, vocab_size=512, finetune_epochs=1.0, finetune_per_class=12,
             finetune_max_length=32, finetune_seeds="0", lsq_steps=64, lsq_freeze_step=20, lsq_weight_std=0.1,
             timeout=300)  # fmt: skip


# ------------------------------------------------------------------------------------ data
def prepare_lm_data(args: SuiteArguments, out: Path) -> Path:
    """Tokenizer and shuffled token blocks, built once and shared by clm and mlm."""
    import torch
    from pretrain import PretrainArguments, build_tokenizer, embedded_corpus, make_blocks

    key = {"chars": args.corpus_chars, "vocab": args.vocab_size, "seq_len": args.lm_seq_len, "seed": 0}
    data = out / "data" / f"lm_{args.corpus_chars}_{args.vocab_size}_{args.lm_seq_len}"
    meta = data / "meta.json"
    if meta.exists() and json.loads(meta.read_text()).get("key") == key:
        return data
    data.mkdir(parents=True, exist_ok=True)
    texts = embedded_corpus(args.corpus_chars)
    tokenizer = build_tokenizer(PretrainArguments(vocab_size=args.vocab_size), texts, data / "tokenizer")
    blocks = make_blocks(tokenizer, texts, args.lm_seq_len)
    blocks = blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0))]  # one split
    torch.save(blocks, data / "blocks.pt")
    meta.write_text(json.dumps({"key": key, "texts": len(texts), "blocks": list(blocks.shape)}))
    return data


def prepare_finetune_data(args: SuiteArguments, out: Path, seed: int) -> Path:
    from suite.finetune import docstring_dataset

    # the name says what was generated: a saved run is reused only on the same data (suite/launch.same_run)
    data = out / "data" / f"finetune_seed{seed}_per_class{args.finetune_per_class}_eval{args.finetune_eval_fraction:g}"
    data.mkdir(parents=True, exist_ok=True)
    ds = docstring_dataset(per_class=args.finetune_per_class, eval_fraction=args.finetune_eval_fraction, seed=seed)
    (data / "docstrings.json").write_text(json.dumps(ds))
    return data


def check_settings(text: str) -> None:
    """``--settings`` must be a JSON object (checked before any run starts)."""
    if not text:
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        example = '{"clip_to_variance": false}'
        raise SystemExit(f"--settings is not valid JSON ({err}); give an object, e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise SystemExit(f"--settings must be a JSON object of keyword arguments, got {text!r}")


def make_spec(
    args: SuiteArguments, workload: str, optimizer: str, data: Path, run_dir: Path, seed: int, steps: int | None = None
) -> dict:
    """One run's settings (``steps``: the CLM run length of the sweep, else the workload's own)."""
    spec = {"workload": workload, "optimizer": optimizer, "run_dir": str(run_dir), "data_dir": str(data)}
    spec.update(seed=seed, weight_decay=args.weight_decay, follow_gradient_scale=args.follow_gradient_scale)
    if workload == "finetune":
        spec.update(lr=args.finetune_lr, epochs=args.finetune_epochs, warmup_ratio=args.finetune_warmup_ratio)
        spec.update(max_length=args.finetune_max_length, log_every=2)
    elif workload == "lsq":
        spec.update(steps=args.lsq_steps, warmup_steps=0, lr=args.lsq_lr)
        freeze = {"onebit_adam": "freeze_step", "zeroone_adam": "var_freeze_step"}.get(optimizer)
        spec.update(settings={freeze: args.lsq_freeze_step} if freeze else {})
        spec.update(betas=[0.9, 0.99], batch_size=args.lsq_batch_size, max_grad_norm=0.0, eval_size=4096)
        spec.update(lsq_in=128, lsq_out=32, lsq_noise=args.lsq_noise, lsq_weight_std=args.lsq_weight_std)
    else:
        steps = steps or (args.clm_steps if workload == "clm" else args.mlm_steps)
        warm = max(1, round(steps * args.lm_warmup_ratio))
        spec.update(steps=steps, warmup_steps=warm, lr=args.lm_lr, batch_size=args.lm_batch_size)
        spec.update(hidden_size=args.lm_hidden_size, num_layers=args.lm_num_layers, num_heads=args.lm_num_heads)
        spec.update(max_grad_norm=args.lm_max_grad_norm, eval_size=args.lm_eval_sequences)
    if args.settings and optimizer in ("onebit_adam", "zeroone_adam"):
        # clm, mlm, lsq: optimizer keyword arguments; finetune: ZeroOneTrainingArguments fields
        spec["settings"] = {**spec.get("settings", {}), **json.loads(args.settings)}
    defaults = package_defaults(optimizer, trainer=workload == "finetune")  # fine-tuning goes through the Trainer
    if defaults is not None:  # a saved run of other defaults is run again
        spec["package_defaults"] = defaults
    return spec


def plan(args: SuiteArguments) -> list[tuple[str, str, int | None, list[int]]]:
    """``(row name, workload, steps or None, seeds)`` for every row of the table, in order."""
    rows = []
    for workload in args.workloads.split(","):
        if workload == "clm_lengths":
            seeds = int_list("length_seeds", args.length_seeds)
            rows += [(f"clm_{t}", "clm", t, seeds) for t in int_list("clm_lengths", args.clm_lengths)]
        else:
            seeds = args.finetune_seeds if workload == "finetune" else args.seeds
            rows.append((workload, workload, None, int_list("seeds", seeds)))
    return rows


def main(argv: list[str] | None = None) -> dict:
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else argv
    (args,) = HfArgumentParser(SuiteArguments).parse_args_into_dataclasses(argv)
    check_settings(args.settings)
    if args.settings and "finetune" in args.workloads.split(","):
        from suite.finetune import unknown_trainer_settings

        problem = unknown_trainer_settings(json.loads(args.settings))
        if problem:
            raise SystemExit(problem)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "recipes/convergence.py", *argv])  # quoted: copied into a shell, it runs as it ran
    args.code = code_version()  # reported with the settings
    results: dict[str, dict] = {}
    if args.report_only:
        saved = json.loads((out / "results.json").read_text())
        command, results, args.code = saved["command"], saved["results"], saved.get("code", "unknown")
        (out / "results.md").write_text(markdown(results, command, args))
        plot(results, out)
        print((out / "results.md").read_text())
        return results

    def save() -> None:
        (out / "results.json").write_text(json.dumps({"command": command, "code": args.code, "results": results}))
        (out / "results.md").write_text(markdown(results, command, args))

    for row, workload, steps, seeds in plan(args):
        nproc = args.lsq_nproc if workload == "lsq" else args.nproc
        per_seed: dict[str, dict[str, dict]] = {}  # optimizer -> seed -> result
        for seed in seeds:
            if workload == "finetune":
                data = prepare_finetune_data(args, out, seed)
            else:
                data = prepare_lm_data(args, out) if workload in ("clm", "mlm") else out
            for name in args.optimizers.split(","):
                run_dir = out / "runs" / row / f"seed{seed}" / name
                spec = make_spec(args, workload, name, data, run_dir, seed, steps)
                result = run(spec, nproc, args.timeout, f"{row}/seed{seed}", resume=not args.rerun)
                per_seed.setdefault(name, {})[str(seed)] = result
            results[row] = {n: mean_over_seeds(runs) for n, runs in per_seed.items()}  # paired: whole seeds
            save()
        plot({row: results[row]}, out)
    print("\n" + (out / "results.md").read_text())
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and {', '.join(f'{w}.png' for w in results)}")
    if any("error" in r for runs in results.values() for r in runs.values()):
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
