"""ZeroOneTrainer, ZeroOneTrainingArguments and plain Trainer with our optimizers, on 2 gloo ranks."""

import json
import os
import warnings

import pytest
import torch

from _dist import run_ranks

pytest.importorskip("transformers")


def _args(out_dir, **kw):
    from hf_zeroone import ZeroOneTrainingArguments

    base = dict(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=24,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        warmup_steps=4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    if kw.get("optim_compression", "zeroone_adam") == "zeroone_adam":  # 0/1 Adam's fields are its own
        base.update(var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)
    base.update(kw)
    return ZeroOneTrainingArguments(**base)


def _train_choice(rank, world, out_dir, optim):
    from hf_zeroone import ZeroOneTrainer

    from _hf import TokenParityDataset, flat, tiny_bert

    model = tiny_bert()
    trainer = ZeroOneTrainer(
        model=model, args=_args(out_dir, optim_compression=optim), train_dataset=TokenParityDataset()
    )
    trainer.train()
    return {"hook": trainer._hooked_optimizer is not None, "log": trainer.state.log_history, "flat": flat(model)}


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw_torch", "onebit_adam", "zeroone_adam", "onebit_diloco"])
def test_trainer_trains_with_each_optimizer(tmp_path, optim):
    res = run_ranks(_train_choice, 2, str(tmp_path), optim, timeout=300)
    assert torch.equal(res[0]["flat"], res[1]["flat"])  # replicas identical at the end
    steps = [e for e in res[0]["log"] if "loss" in e]
    assert len(steps) == 24
    # single-batch losses are noisy (the last two batches are hard ones for every optimizer): compare means
    assert sum(e["loss"] for e in steps[-6:]) < sum(e["loss"] for e in steps[:6]) - 0.05 * 6 * steps[0]["loss"]
    if optim == "adamw_torch":
        assert not res[0]["hook"]
        return
    assert res[0]["hook"]
    if optim == "onebit_diloco":  # local steps; a 1-bit sync every 4th (the default), the same bytes each
        sent = [e["comm/bytes_sent"] for e in steps]
        assert all((b > 0) == (i % 4 == 3) for i, b in enumerate(sent)) and len({b for b in sent if b}) == 1, sent
        assert all(e["comm/local_phase"] == 1 for e in steps)
        return
    for entry in steps:
        assert {"comm/bytes_sent", "comm/bytes_total", "comm/compression_ratio", "comm/local_phase"} <= set(entry)
    warmup_bytes = steps[0]["comm/bytes_sent"]
    assert warmup_bytes > 0
    # after the exact phase, compressed steps send at most 1/6 of an exact step (float8 messages, a
    # quarter of fp32's bytes, so 1/8 on a large model; about 1/7 on this small model, with the
    # per-segment scales and the per-parameter blocks)
    compressed = [e["comm/bytes_sent"] for e in steps[8:] if 0 < e["comm/bytes_sent"] < warmup_bytes]
    assert compressed, [e["comm/bytes_sent"] for e in steps]
    assert max(compressed) <= warmup_bytes / 6
    if optim == "zeroone_adam":
        assert any(e["comm/bytes_sent"] == 0 for e in steps)  # local steps
        assert steps[-1]["comm/local_phase"] == 1


def _user_optimizer(rank, world, out_dir, plain):
    from transformers import Trainer, TrainingArguments

    from hf_zeroone import OneBitAdam, ZeroOneAdam, ZeroOneTrainer

    from _hf import TokenParityDataset, flat, tiny_bert

    model = tiny_bert()
    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, max_steps=12, per_device_train_batch_size=8, report_to=[],
        save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if plain:
            opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=3)
            trainer = Trainer(model=model, args=args, train_dataset=TokenParityDataset(), optimizers=(opt, None))
        else:
            # local_step_scaler: every local-phase step syncs, so the final parameters agree
            opt = ZeroOneAdam(
                model.parameters(), lr=1e-3, var_freeze_step=6, var_update_scaler=1, local_step_scaler=1000
            )
            trainer = ZeroOneTrainer(model=model, args=args, train_dataset=TokenParityDataset(), optimizers=(opt, None))
        trainer.train()
    return {
        "flat": flat(model),
        "hook": getattr(trainer, "_hook_state", None) is not None,
        "warnings": [str(w.message) for w in caught],
        "kinds_step": opt.schedule["step"],
        "log": trainer.state.log_history,
    }


@pytest.mark.slow
def test_user_built_optimizer_gets_the_hook(tmp_path):
    res = run_ranks(_user_optimizer, 2, str(tmp_path), False, timeout=300)
    assert res[0]["hook"] and torch.equal(res[0]["flat"], res[1]["flat"])
    assert res[0]["kinds_step"] == 12
    assert any("comm/bytes_sent" in e for e in res[0]["log"])


@pytest.mark.slow
def test_plain_trainer_with_our_optimizer_stays_in_sync_and_warns(tmp_path):
    res = run_ranks(_user_optimizer, 2, str(tmp_path), True, timeout=300)
    assert torch.equal(res[0]["flat"], res[1]["flat"])
    assert res[0]["kinds_step"] == 12
    assert sum("use hf_zeroone.ZeroOneTrainer" in w for w in res[0]["warnings"]) == 1


def _resume(rank, world, out_dir, phase):
    from hf_zeroone import ZeroOneTrainer

    from _hf import TokenParityDataset, flat, tiny_bert

    model = tiny_bert()
    kw = dict(optim_compression="zeroone_adam", max_steps=20, warmup_steps=2)
    if phase == "straight":
        args = _args(os.path.join(out_dir, "a"), save_strategy="steps", save_steps=10, **kw)
        trainer = ZeroOneTrainer(model=model, args=args, train_dataset=TokenParityDataset())
        trainer.train()
    else:
        args = _args(os.path.join(out_dir, "b"), **kw)
        trainer = ZeroOneTrainer(model=model, args=args, train_dataset=TokenParityDataset())
        trainer.train(resume_from_checkpoint=os.path.join(out_dir, "a", "checkpoint-10"))
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    return {"flat": flat(model), "schedule": dict(opt.schedule)}


@pytest.mark.slow
def test_resume_continues_bit_identically_and_on_another_world_size_warns(tmp_path):
    straight = run_ranks(_resume, 2, str(tmp_path), "straight", timeout=300)
    ckpt = tmp_path / "a" / "checkpoint-10"
    assert (ckpt / "hf_zeroone_optimizer_rank0.pt").exists() and (ckpt / "hf_zeroone_optimizer_rank1.pt").exists()
    saved = [torch.load(ckpt / f"hf_zeroone_optimizer_rank{r}.pt", weights_only=True) for r in range(2)]
    errors = [
        torch.cat([s["worker_error"].flatten() for s in sd["state"].values() if "worker_error" in s]) for sd in saved
    ]
    assert not torch.equal(errors[0], errors[1])  # each rank's own error buffers were kept
    resumed = run_ranks(_resume, 2, str(tmp_path), "resume", timeout=300)
    for r in range(2):
        assert torch.equal(straight[r]["flat"], resumed[r]["flat"])
        assert straight[r]["schedule"] == resumed[r]["schedule"]

    # One process from the two-rank checkpoint: error buffers reset with a warning, training goes on.
    from hf_zeroone import ZeroOneTrainer

    from _hf import TokenParityDataset, tiny_bert

    args = _args(str(tmp_path / "c"), optim_compression="zeroone_adam", max_steps=20, warmup_steps=2)
    trainer = ZeroOneTrainer(model=tiny_bert(), args=args, train_dataset=TokenParityDataset())
    with pytest.warns(UserWarning, match="error-feedback buffers reset"):
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 20
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def _clip_choice(rank, world, out_dir, max_grad_norm):
    from hf_zeroone import ZeroOneTrainer

    from _hf import TokenParityDataset, tiny_bert

    args = _args(out_dir, optim_compression="onebit_adam", max_steps=60, warmup_steps=6, max_grad_norm=max_grad_norm)
    trainer = ZeroOneTrainer(model=tiny_bert(), args=args, train_dataset=TokenParityDataset(n=1024))
    trainer.train()
    return [e for e in trainer.state.log_history if "loss" in e]


@pytest.mark.slow
def test_onebit_adam_with_the_trainers_default_clipping_learns_as_without_clipping(tmp_path):
    clipped = run_ranks(_clip_choice, 2, str(tmp_path / "a"), 1.0, timeout=300)[0]
    free = run_ranks(_clip_choice, 2, str(tmp_path / "b"), 0.0, timeout=300)[0]

    def late_loss(log):
        return sum(e["loss"] for e in log[-15:]) / 15

    assert late_loss(clipped) < 1.02 * late_loss(free), (late_loss(clipped), late_loss(free))
    norms = torch.tensor([e["grad_norm"] for e in clipped])
    assert norms[10:].median() < 2 * norms[2:6].median(), norms  # gradient-sized after compression starts


def test_an_epoch_based_run_derives_the_schedule_from_its_length(tmp_path):
    """transformers 4.x creates the optimizer before its TrainerState knows max_steps."""
    from transformers import TrainingArguments

    from hf_zeroone import ZeroOneTrainer, ZeroOneTrainingArguments

    from _hf import TokenParityDataset, tiny_bert

    # 10% warm-up, spelt as each transformers version accepts it
    has_ratio = "warmup_ratio" in TrainingArguments.__dataclass_fields__
    ratio = dict(warmup_ratio=0.1) if has_ratio else dict(warmup_steps=0.1)
    args = ZeroOneTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, num_train_epochs=3, per_device_train_batch_size=8,
        report_to=[], save_strategy="no", disable_tqdm=True, optim_compression="zeroone_adam", **ratio,
    )  # fmt: skip
    trainer = ZeroOneTrainer(model=tiny_bert(), args=args, train_dataset=TokenParityDataset(n=80))
    trainer.create_optimizer_and_scheduler(num_training_steps=30)  # 3 epochs of 10 steps
    assert (trainer.optimizer.exact_warmup_steps, trainer.optimizer.var_freeze_step) == (9, 9)

    trainer = ZeroOneTrainer(model=tiny_bert(), args=args, train_dataset=TokenParityDataset(n=80))
    trainer.train()
    assert trainer.state.global_step == 30
    assert (trainer.optimizer.optimizer.exact_warmup_steps, trainer.optimizer.optimizer.var_freeze_step) == (9, 9)


def test_every_flag_parses_from_the_command_line_and_json(tmp_path):
    from transformers import HfArgumentParser

    from hf_zeroone import ZeroOneTrainingArguments

    argv = [
        "--output_dir", str(tmp_path), "--optim_compression", "onebit_adam", "--freeze_step", "7",
        "--onebit_bias_correction", "false", "--overflow_check_on_local_steps", "true", "--log_comm_stats", "false",
    ]  # fmt: skip
    (args,) = HfArgumentParser(ZeroOneTrainingArguments).parse_args_into_dataclasses(argv)
    assert (args.optim_compression, args.freeze_step) == ("onebit_adam", 7)
    assert args.onebit_bias_correction is False
    assert args.overflow_check_on_local_steps is True and args.log_comm_stats is False
    assert args.compression_schedule(100) == {"freeze_step": 7}
    argv = [
        "--output_dir", str(tmp_path), "--var_freeze_step", "9", "--var_update_scaler", "3",
        "--local_step_scaler", "5", "--local_step_clipper", "8", "--exact_warmup_steps", "2",
    ]  # fmt: skip
    (args,) = HfArgumentParser(ZeroOneTrainingArguments).parse_args_into_dataclasses(argv)
    assert (args.optim_compression, args.var_freeze_step, args.exact_warmup_steps) == ("zeroone_adam", 9, 2)
    assert (args.var_update_scaler, args.local_step_scaler, args.local_step_clipper) == (3, 5, 8)

    config = tmp_path / "args.json"
    config.write_text(
        json.dumps({"output_dir": str(tmp_path), "optim_compression": "zeroone_adam", "warmup_steps": 10})
    )
    (args,) = HfArgumentParser(ZeroOneTrainingArguments).parse_json_file(str(config))
    assert args.compression_schedule(1000) == {
        "var_freeze_step": 300,  # the later of twice the warm-up and 30% of the run
        "exact_warmup_steps": 300,  # all of phase 1
        "var_update_scaler": 16,
        "local_step_scaler": 58,  # (1000 - 300) // (4 * log2(8)): the gap reaches 8 a quarter into the local phase
        "local_step_clipper": 8,  # 16, but at most (1000 - 300) // 64 = 10, rounded down to a power of two
    }
    # a 90-step run (freeze at 27, 63 local-phase steps): the largest gap is 1 (63 // 64 is 0), not 16: it syncs
    # at every step of its local phase
    short = args.compression_schedule(90)
    assert (short["var_freeze_step"], short["local_step_clipper"], short["local_step_scaler"]) == (27, 1, 15)
    help_text = HfArgumentParser(ZeroOneTrainingArguments).format_help()
    assert "1-bit Adam: exact steps before compression" in help_text


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(optim_compression="lamb"), "optim_compression must be one of"),
        (dict(freeze_step=-1), "freeze_step must be >= 0"),
        (dict(local_step_clipper=0), "local_step_clipper must be >= 1"),
        # each was accepted until train() (after the model and data were set up), or ignored
        (dict(optim="sgd"), "optim='sgd' would be ignored: optim_compression='zeroone_adam' chooses"),
        (dict(optim="adamw_8bit"), "optim='adamw_8bit' would be ignored"),
        (dict(freeze_step=15), "freeze_step would be ignored: optim_compression='zeroone_adam' takes var_freeze_step"),
        (dict(optim_compression="onebit_adam", local_step_clipper=4), "local_step_clipper would be ignored"),
        (dict(var_freeze_step=0), "var_freeze_step=0 would freeze a variance that was never estimated"),
        (dict(optim_compression="onebit_adam", freeze_step=0), "freeze_step=0 would freeze"),
        (dict(exact_step_dtype="float16"), "float16 is refused"),
        (dict(check_replicas_every=1.5), "check_replicas_every must be an integer"),
    ],
)
def test_bad_training_arguments(tmp_path, kw, match):
    from hf_zeroone import ZeroOneTrainingArguments

    with pytest.raises(ValueError, match=match):
        ZeroOneTrainingArguments(output_dir=str(tmp_path), **kw)


def test_compression_settings_beside_plain_adamw_are_named_as_having_no_effect(tmp_path):
    import warnings

    from hf_zeroone import ZeroOneTrainingArguments

    unused = r"freeze_step, check_replicas_every have no effect: optim_compression='adamw_torch'"
    with pytest.warns(UserWarning, match=unused):
        ZeroOneTrainingArguments(
            output_dir=str(tmp_path), optim_compression="adamw_torch", freeze_step=10, check_replicas_every=5
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ZeroOneTrainingArguments(output_dir=str(tmp_path), optim_compression="adamw_torch")
    assert not [w for w in caught if "no effect" in str(w.message)]


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_an_optim_naming_torchs_adamw_is_what_the_compressed_optimizer_stands_in_for(tmp_path, optim):
    from hf_zeroone import ZeroOneTrainingArguments

    assert ZeroOneTrainingArguments(output_dir=str(tmp_path), optim=optim).optim_compression == "zeroone_adam"


def test_independent_processes_are_detected(monkeypatch):
    from hf_zeroone.integrations import check_distributed_launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="each would train alone"):
        check_distributed_launch("test")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert check_distributed_launch("test") == 1


def test_import_is_light():
    import subprocess
    import sys

    code = "import sys, hf_zeroone; print('transformers' in sys.modules, 'accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False"
