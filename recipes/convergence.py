#!/usr/bin/env python
"""Convergence suite: AdamW, PowerSGD, 1-bit Adam and 0/1 Adam with default settings (docs/convergence.md).

    python recipes/convergence.py --output_dir outputs/convergence
    python recipes/convergence.py --workloads clm_lengths --output_dir outputs/convergence_lengths

Workloads: ``finetune`` (MiniLM via ``ZeroOneTrainer``), ``clm`` and ``mlm`` (``pretrain.py``'s corpus), ``lsq``
(least squares) and ``clm_lengths`` (``clm`` at several run lengths). Writes ``results.md``, ``results.json``,
``<workload>.png`` and ``runs/<row>/seed<S>/<optimizer>/`` into ``--output_dir``; a run whose directory holds the
result of the same spec is not run again (``--rerun`` forces it). ``--quick``: a smoke test.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402 - needs the path
from pretrain import PretrainArguments, arg, build_tokenizer, embedded_corpus, make_blocks  # noqa: E402
from suite import workloads  # noqa: E402
from suite.launch import code_version, package_defaults, parse, run  # noqa: E402
from suite.report import OPTIMIZERS, markdown, mean_over_seeds, plot  # noqa: E402

WORKLOADS = ("finetune", "clm", "mlm", "lsq", "clm_lengths")


@dataclass
class SuiteArguments:
    output_dir: str = arg("outputs/convergence", "Results, plots, run logs, data.")
    workloads: str = arg(",".join(WORKLOADS), f"Comma-separated: {', '.join(WORKLOADS)}.")
    optimizers: str = arg(",".join(OPTIMIZERS), f"Comma-separated: {', '.join(OPTIMIZERS)}.")
    quick: bool = arg(False, "Tiny sizes everywhere (smoke test, seconds per run).")
    report_only: bool = arg(False, "Only rewrite results.md and plots from results.json.")
    nproc: int = arg(2, "Ranks for finetune, clm and mlm.")
    lsq_nproc: int = arg(3, "Ranks for lsq.")
    timeout: int = arg(1800, "Seconds one run may take before it is killed.")
    rerun: bool = arg(False, "Run again the runs whose results are on disk.")
    seeds: str = arg("0", "clm, mlm, lsq: comma-separated seeds (initialisation, data order, masks).")
    finetune_seeds: str = arg("0,1,2", "finetune: comma-separated seeds (split, head, data order); the row: the mean.")
    follow_gradient_scale: bool = arg(True, "False: 1-bit and 0/1 Adam with follow_gradient_scale=False.")
    settings: str = arg("", "JSON object of 1-bit and 0/1 Adam keyword arguments (finetune: ZeroOneTrainingArguments "
                        "fields), a diagnostic (exact_messages: true averages 1-bit messages in fp32).")  # fmt: skip
    clm_lengths: str = arg("200,400,800", "clm_lengths: comma-separated run lengths.")
    length_seeds: str = arg("0,1,2,3", "clm_lengths: comma-separated seeds.")
    weight_decay: float = arg(0.0, "Decoupled weight decay, the same for every optimizer.")
    clm_steps: int = arg(1000, "CLM optimizer steps.")
    mlm_steps: int = arg(500, "MLM optimizer steps.")
    lm_lr: float = arg(1e-3, "LM peak learning rate (linear warm-up, then linear to 0).")
    lm_warmup_ratio: float = arg(0.1, "LM warm-up W, told to 1-bit and 0/1 Adam by set_run_length(T, W).")
    lm_batch_size: int = arg(8, "LM sequences per rank and step.")
    lm_seq_len: int = arg(64, "LM tokens per sequence.")
    lm_hidden_size: int = arg(128, "LM width.")
    lm_num_layers: int = arg(2, "LM transformer layers.")
    lm_num_heads: int = arg(2, "LM attention heads.")
    lm_max_grad_norm: float = arg(1.0, "LM gradient clipping as pretrain.py (0: off).")
    lm_eval_sequences: int = arg(128, "Held-out sequences for the LM metric.")
    corpus_chars: int = arg(3_000_000, "Size of the embedded docstring corpus.")
    vocab_size: int = arg(4096, "BPE vocabulary trained on the corpus.")
    finetune_lr: float = arg(1e-4, "Fine-tuning learning rate.")
    finetune_epochs: float = arg(3.0, "Fine-tuning epochs (Trainer default).")
    finetune_warmup_ratio: float = arg(0.1, "Fine-tuning warm-up (fraction of steps).")
    finetune_per_class: int = arg(0, "Docstrings per class (0: all the smallest has).")
    finetune_eval_fraction: float = arg(0.4, "Held-out share of each class.")
    finetune_max_length: int = arg(64, "Tokens per docstring (truncated).")
    lsq_steps: int = arg(640, "Least-squares steps.")
    lsq_freeze_step: int = arg(200, "Least squares: freeze_step / var_freeze_step.")
    lsq_lr: float = arg(1e-2, "Least squares: lr, decaying linearly to 0.")
    lsq_batch_size: int = arg(16, "Least squares: samples per rank and step.")
    lsq_noise: float = arg(0.1, "Least squares: label noise std (floor: its square).")
    lsq_weight_std: float = arg(1.0, "Least squares: std of the true weights.")

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
             lm_hidden_size=32, lm_eval_sequences=16, corpus_chars=150_000, vocab_size=512, finetune_epochs=1.0,
             finetune_per_class=12, finetune_max_length=32, finetune_seeds="0", lsq_steps=64, lsq_freeze_step=20,
             lsq_weight_std=0.1, timeout=300)  # fmt: skip


def prepare_lm_data(args: SuiteArguments, out: Path) -> Path:
    """Tokenizer and shuffled token blocks, built once and shared by clm and mlm."""
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
    """The seed's docstring split, in a directory named by what it holds (saved runs are reused on the same data)."""
    per_class, fraction = args.finetune_per_class, args.finetune_eval_fraction
    data = out / "data" / f"finetune_seed{seed}_per_class{per_class}_eval{fraction:g}"
    data.mkdir(parents=True, exist_ok=True)
    ds = workloads.docstring_dataset(per_class=per_class, eval_fraction=fraction, seed=seed)
    (data / "docstrings.json").write_text(json.dumps(ds))
    return data


def check_settings(args: SuiteArguments) -> None:
    """``--settings`` must be a JSON object (of Trainer argument fields for finetune), checked before any run."""
    if not args.settings:
        return
    try:
        value = json.loads(args.settings)
    except json.JSONDecodeError as err:
        example = '{"clip_to_variance": false}'
        raise SystemExit(f"--settings is not valid JSON ({err}); give an object, e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise SystemExit(f"--settings must be a JSON object of keyword arguments, got {args.settings!r}")
    problem = "finetune" in args.workloads.split(",") and workloads.unknown_trainer_settings(value)
    if problem:
        raise SystemExit(problem)


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
    """Run every row of ``plan`` (or only rewrite the report) and write the results."""
    args, command = parse(SuiteArguments, argv, "convergence.py")
    check_settings(args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    args.code = code_version()  # reported with the settings
    results: dict[str, dict] = {}
    if args.report_only:
        saved = json.loads((out / "results.json").read_text())
        command, results, args.code = saved["command"], saved["results"], saved.get("code", "unknown")
        (out / "results.md").write_text(markdown(results, command, args))
        plot(results, out)
        print((out / "results.md").read_text())
        return results
    for row, workload, steps, seeds in plan(args):
        nproc = args.lsq_nproc if workload == "lsq" else args.nproc
        per_seed: dict[str, dict[str, dict]] = {}  # optimizer -> seed -> result
        for seed in seeds:
            if workload == "finetune":
                data = prepare_finetune_data(args, out, seed)
            else:
                data = prepare_lm_data(args, out) if workload in ("clm", "mlm") else out
            for name in args.optimizers.split(","):
                spec = make_spec(args, workload, name, data, out / "runs" / row / f"seed{seed}" / name, seed, steps)
                result = run(spec, nproc, args.timeout, f"{row}/seed{seed}", resume=not args.rerun)
                per_seed.setdefault(name, {})[str(seed)] = result
            results[row] = {n: mean_over_seeds(runs) for n, runs in per_seed.items()}  # paired: whole seeds
            (out / "results.json").write_text(json.dumps({"command": command, "code": args.code, "results": results}))
            (out / "results.md").write_text(markdown(results, command, args))
        plot({row: results[row]}, out)
    print("\n" + (out / "results.md").read_text())
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and {', '.join(f'{w}.png' for w in results)}")
    if any("error" in r for runs in results.values() for r in runs.values()):
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
