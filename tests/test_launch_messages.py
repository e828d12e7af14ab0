"""Set-up and launch mistakes get clear messages; settings that differ between transformers versions work on all."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from _hf import TokenParityDataset, tiny_bert  # noqa: E402


def test_warmup_ratio_works_as_keyword_and_flag():
    from transformers import HfArgumentParser

    from hf_zeroone import ZeroOneTrainingArguments

    args = ZeroOneTrainingArguments(output_dir="out", optim_compression="zeroone_adam", warmup_ratio=0.1, report_to=[])
    assert args.get_warmup_steps(1000) == 100
    assert args.compression_schedule(1000)["exact_warmup_steps"] == 300  # all of phase 1
    assert args.compression_schedule(1000)["var_freeze_step"] == 300
    (parsed,) = HfArgumentParser(ZeroOneTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--optim_compression", "onebit_adam", "--warmup_ratio", "0.25", "--report_to", "none"]
    )
    # the variance freezes at the later of the warm-up and 30% of the run
    assert parsed.get_warmup_steps(40) == 10 and parsed.compression_schedule(40) == {"freeze_step": 12}
    # whole steps mean the same on every version; no warm-up at all falls back to 10% of the run
    steps = ZeroOneTrainingArguments(output_dir="out", optim_compression="onebit_adam", warmup_steps=7, report_to=[])
    assert steps.compression_schedule(1000) == {"freeze_step": 300}
    assert steps.compression_schedule(20) == {"freeze_step": 7}
    none = ZeroOneTrainingArguments(output_dir="out", optim_compression="onebit_adam", report_to=[])
    assert none.compression_schedule(1000) == {"freeze_step": 300}


def test_warmup_ratio_out_of_range_is_refused():
    from transformers import TrainingArguments

    from hf_zeroone import ZeroOneTrainingArguments

    if "warmup_ratio" in {f.name for f in dataclasses.fields(TrainingArguments)}:
        pytest.skip("transformers 4.x validates its own warmup_ratio")
    with pytest.raises(ValueError, match="warmup_ratio must be in"):
        ZeroOneTrainingArguments(output_dir="out", warmup_ratio=1.5, report_to=[])
    with pytest.raises(ValueError, match="not both"):
        ZeroOneTrainingArguments(output_dir="out", warmup_ratio=0.1, warmup_steps=10, report_to=[])


class _NoDistributed:
    distributed_type = type("T", (), {"name": "NO"})()
    num_processes = 1
    mixed_precision = "no"


def test_prepare_zeroone_in_one_process_warns_with_the_working_launch_commands():
    from hf_zeroone import ZeroOneAdam
    from hf_zeroone.integrations import SingleProcessWarning, prepare_zeroone

    model = torch.nn.Linear(2, 2)
    with pytest.warns(SingleProcessWarning) as caught:
        assert prepare_zeroone(_NoDistributed(), model, ZeroOneAdam(model.parameters())) is None
    (message,) = [str(w.message) for w in caught]
    assert "\n" not in message and "sends nothing" in message
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2" in message
    assert "--cpu --num_processes 2` starts ONE process" in message
    assert caught[0].filename == __file__  # points at the caller's line


def test_one_process_trainer_warns_and_logs_comm_stats_in_the_final_summary(tmp_path):
    from hf_zeroone import ZeroOneTrainer, ZeroOneTrainingArguments
    from hf_zeroone.integrations import SingleProcessWarning, unwrap_optimizer

    args = ZeroOneTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=4, per_device_train_batch_size=8, report_to=[],
        save_strategy="no", disable_tqdm=True, optim_compression="onebit_adam", warmup_ratio=0.5,
    )  # fmt: skip
    assert args.logging_steps > args.max_steps  # no loss-logging step in this run
    trainer = ZeroOneTrainer(model=tiny_bert(), args=args, train_dataset=TokenParityDataset(n=64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    single = [w for w in caught if issubclass(w.category, SingleProcessWarning)]
    assert len(single) == 1 and "torchrun --nproc_per_node 2 script.py --use_cpu" in str(single[0].message)
    assert unwrap_optimizer(trainer.optimizer).freeze_step == 2  # warmup_ratio=0.5 of 4 steps
    final = trainer.state.log_history[-1]
    assert "train_loss" in final and final["comm/bytes_total"] == 0 and final["comm/hook"] == 0
    assert "comm/compression_ratio" not in final  # nothing sent: no ratio rather than a misleading 0


def test_comm_log_entries_document_every_key():
    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.integrations import comm_log_entries
    from hf_zeroone.integrations import stats as stats_module

    doc = stats_module.comm_log_entries.__doc__
    for opt in (OneBitAdam(torch.nn.Linear(2, 2).parameters()), ZeroOneAdam(torch.nn.Linear(2, 2).parameters())):
        for key in comm_log_entries(opt):
            assert f"``{key}``" in doc, key
