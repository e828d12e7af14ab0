"""DeepSpeed configs in: ``from_deepspeed_config`` and ``ZeroOneTrainingArguments(from_deepspeed_config=...)``."""

import json
import warnings

import pytest
import torch

from hf_zeroone import DeepSpeedConfigNote, OneBitAdam, ZeroOneAdam, from_deepspeed_config

# The optimizer sections of DeepSpeed's own tutorials (deepspeed.ai/tutorials/onebit-adam and zero-one-adam),
# the configs a user of DeepSpeed <= 0.19.6 ran.
ONEBIT_TUTORIAL = {
    "train_batch_size": 4096,
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {
        "type": "OneBitAdam",
        "params": {"lr": 4e-4, "freeze_step": 23000, "cuda_aware": False, "comm_backend_name": "nccl"},
    },
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}
ZEROONE_TUTORIAL = {
    "train_batch_size": 128,
    "train_micro_batch_size_per_gpu": 32,
    "optimizer": {
        "type": "ZeroOneAdam",
        "params": {
            "lr": 1e-3,
            "weight_decay": 0.01,
            "bias_correction": False,
            "var_freeze_step": 1000,
            "var_update_scaler": 16,
            "local_step_scaler": 1000,
            "local_step_clipper": 16,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    },
    "gradient_clipping": 1.0,
}


def _params():
    return [torch.nn.Parameter(torch.zeros(4, 3))]


def _load(config, **overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = from_deepspeed_config(_params(), config, **overrides)
    return opt, [str(w.message) for w in caught if issubclass(w.category, DeepSpeedConfigNote)]


def test_deepspeeds_one_bit_adam_tutorial_config_loads(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ONEBIT_TUTORIAL))
    opt, notes = _load(str(path))  # a JSON path works as the dict does
    assert isinstance(opt, OneBitAdam) and opt.freeze_step == 23000
    assert opt.param_groups[0]["lr"] == 4e-4 and opt.param_groups[0]["bias_correction"]
    assert opt.param_groups[0]["weight_decay"] == 0.0  # left out: DeepSpeed's default, not AdamW's 1e-2
    text = "\n".join(notes)
    for name in ("cuda_aware", "comm_backend_name", "gradient_clipping", "bias_correction"):
        assert name in text, (name, notes)
    assert all("\n" not in n for n in notes)  # one line each


def test_deepspeeds_zero_one_adam_tutorial_config_loads():
    opt, notes = _load(ZEROONE_TUTORIAL)
    assert isinstance(opt, ZeroOneAdam)
    assert (opt.var_freeze_step, opt.var_update_scaler, opt.local_step_scaler, opt.local_step_clipper) == (
        1000,
        16,
        1000,
        16,
    )
    group = opt.param_groups[0]
    assert group["weight_decay"] == 0.01 and group["lr"] == 1e-3
    assert group["bias_correction"] is False  # asked for: as DeepSpeed did
    assert not any("bias_correction" in n for n in notes)


def test_defaults_that_differ_from_deepspeeds_are_noted_unless_set():
    """A DeepSpeed user learns which defaults change the run, and the keyword that restores DeepSpeed's."""
    _, notes = _load(ZEROONE_TUTORIAL)
    text = "\n".join(notes)
    assert "exact_step_dtype=torch.float32" in text and "exact_warmup_steps=0" in text
    _, notes = _load(ONEBIT_TUTORIAL)
    assert any("exact_step_dtype" in n for n in notes) and not any("exact_warmup_steps" in n for n in notes)
    opt, notes = _load(ZEROONE_TUTORIAL, exact_step_dtype=torch.float32, exact_warmup_steps=0)
    assert not any("exact_" in n for n in notes)
    assert opt.exact_step_dtype == torch.float32 and opt.exact_warmup_steps == 0
    _, notes = _load(ZEROONE_TUTORIAL, exact_warmup_steps=0)  # each option silences its own note only
    assert any("exact_step_dtype" in n for n in notes) and not any("exact_warmup_steps" in n for n in notes)
    _, notes = _load(ONEBIT_TUTORIAL, bias_correction=False)
    assert not any("bias_correction" in n for n in notes)


def test_trainer_flags_set_beside_a_deepspeed_config_silence_its_notes(tmp_path):
    pytest.importorskip("transformers")
    from hf_zeroone import ZeroOneTrainingArguments

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZEROONE_TUTORIAL))

    def notes(**flags):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ZeroOneTrainingArguments(output_dir=str(tmp_path), from_deepspeed_config=str(path), report_to=[], **flags)
        return [str(w.message) for w in caught if issubclass(w.category, DeepSpeedConfigNote)]

    assert sum("exact_" in n for n in notes()) == 2
    assert not any("exact_" in n for n in notes(exact_step_dtype="float32", exact_warmup_steps=0))
    config = dict(ZEROONE_TUTORIAL, optimizer={"type": "ZeroOneAdam", "params": {"lr": 1e-3}})  # bias_correction unset
    path.write_text(json.dumps(config))
    assert any("bias_correction" in n for n in notes())
    assert not any("bias_correction" in n for n in notes(onebit_bias_correction=False))


def test_notes_point_at_the_users_line_in_both_paths(tmp_path):
    """A note names the user's file and line, not hf_zeroone's nor a dataclass's generated ``__init__``."""
    pytest.importorskip("transformers")
    from hf_zeroone import ZeroOneTrainingArguments

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZEROONE_TUTORIAL))

    def files(build):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build()
        return [w.filename for w in caught if issubclass(w.category, DeepSpeedConfigNote)]

    for build in (
        lambda: from_deepspeed_config(_params(), ZEROONE_TUTORIAL),
        lambda: ZeroOneTrainingArguments(output_dir=str(tmp_path), from_deepspeed_config=str(path), report_to=[]),
    ):
        named = files(build)
        assert named and set(named) == {__file__}, named


def test_every_parameter_deepspeed_accepted_is_mapped_or_noted():
    params = {
        "lr": 2e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1, "bias_correction": True,
        "eps_inside_sqrt": True, "max_grad_norm": 1.0, "amsgrad": False, "cuda_aware": True,
        "comm_backend_name": "mpi", "freeze_step": 7,
    }  # fmt: skip
    opt, notes = _load({"optimizer": {"type": "onebitadam", "params": params}})
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"], opt.freeze_step) == (2e-4, (0.8, 0.99), 1e-6, 0.1, 7)
    for name in ("eps_inside_sqrt", "max_grad_norm", "cuda_aware", "comm_backend_name"):
        assert any(name in n for n in notes), name


@pytest.mark.parametrize(
    ("optimizer", "match"),
    [
        ({"type": "OneBitLamb", "params": {"lr": 1e-3}}, "1-bit LAMB"),
        ({"type": "AdamW", "params": {"lr": 1e-3}}, "not a 1-bit optimizer"),
        ({"type": "OneBitAdam", "params": {"lr": 1e-3, "amsgrad": True}}, "amsgrad"),
        ({"type": "ZeroOneAdam", "params": {"lr": 1e-3, "freeze_step": 10}}, "unknown.*var_freeze_step"),
        ({"type": "OneBitAdam", "params": {"lr": "auto"}}, '"auto"'),
    ],
)
def test_what_cannot_be_honoured_is_a_clear_error(optimizer, match):
    with pytest.raises(ValueError, match=match):
        _load({"optimizer": optimizer})


def test_auto_values_and_overrides():
    config = {"optimizer": {"type": "ZeroOneAdam", "params": {"lr": "auto", "weight_decay": "auto"}}}
    opt, _ = _load(config, lr=3e-4, weight_decay=0.05, follow_gradient_scale=False)
    assert opt.param_groups[0]["lr"] == 3e-4 and opt.param_groups[0]["weight_decay"] == 0.05
    assert opt.follow_gradient_scale is False
    with pytest.raises(ValueError, match="optimizer"):
        _load({"zero_optimization": {"stage": 0}})
    with pytest.raises(ValueError, match="does not exist"):
        _load("/no/such/ds_config.json")


def test_training_arguments_take_the_optimizer_from_a_deepspeed_config(tmp_path):
    pytest.importorskip("transformers")
    from hf_zeroone import ZeroOneTrainingArguments

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZEROONE_TUTORIAL))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigNote)
        args = ZeroOneTrainingArguments(output_dir=str(tmp_path), from_deepspeed_config=str(path), report_to=[])
        assert args.optim_compression == "zeroone_adam"
        assert (args.learning_rate, args.weight_decay, args.onebit_bias_correction) == (1e-3, 0.01, False)
        assert (args.var_freeze_step, args.local_step_scaler, args.local_step_clipper) == (1000, 1000, 16)
        with pytest.raises(ValueError, match="learning_rate.*differ"):
            ZeroOneTrainingArguments(
                output_dir=str(tmp_path), from_deepspeed_config=str(path), learning_rate=5e-4, report_to=[]
            )
        # a config without weight_decay leaves --weight_decay to the user (and its default, 0.0)
        bare = tmp_path / "bare.json"
        bare.write_text(json.dumps({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}))
        for given, expected in (({}, 0.0), ({"weight_decay": 0.1}, 0.1)):
            args = ZeroOneTrainingArguments(
                output_dir=str(tmp_path), from_deepspeed_config=str(bare), report_to=[], **given
            )
            assert args.weight_decay == expected


def _trainer_from_deepspeed(rank, world, out_dir, config_path):
    import warnings as w

    from hf_zeroone import ZeroOneTrainer, ZeroOneTrainingArguments
    from hf_zeroone.integrations import unwrap_optimizer

    from _hf import TokenParityDataset, tiny_bert

    w.simplefilter("ignore", DeepSpeedConfigNote)
    args = ZeroOneTrainingArguments(
        output_dir=out_dir, use_cpu=True, max_steps=8, per_device_train_batch_size=8, report_to=[],
        save_strategy="no", disable_tqdm=True, from_deepspeed_config=config_path,
    )  # fmt: skip
    trainer = ZeroOneTrainer(model=tiny_bert(), args=args, train_dataset=TokenParityDataset())
    trainer.train()
    opt = unwrap_optimizer(trainer.optimizer)
    return type(opt).__name__, opt.freeze_step, args.learning_rate, trainer._hook_state is not None


@pytest.mark.slow
def test_the_trainer_trains_with_a_deepspeed_configs_optimizer(tmp_path):
    pytest.importorskip("transformers")
    from _dist import run_ranks

    config = dict(ONEBIT_TUTORIAL, optimizer={"type": "OneBitAdam", "params": {"lr": 2e-3, "freeze_step": 3}})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    res = run_ranks(_trainer_from_deepspeed, 2, str(tmp_path), str(path), timeout=200)
    assert res[0] == ("OneBitAdam", 3, 2e-3, True)


def test_a_weight_decay_left_out_of_the_config_is_deepspeeds_unless_given():
    config = {"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3}}}
    assert _load(config)[0].param_groups[0]["weight_decay"] == 0.0
    assert _load(config, weight_decay=0.05)[0].param_groups[0]["weight_decay"] == 0.05
