"""``exact_step_dtype``: its checks, and the Trainer flag that sets it.

What it does on 2 ranks (half the bytes of an exact step, the hook and ``step()`` bit-identical,
the same final loss) is tested in ``test_ddp_hook.py`` and ``test_convergence_defaults.py``.
"""

import pytest
import torch

from hf_zeroone import OneBitAdam, ZeroOneAdam


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, None),
        (torch.float32, torch.float32),
        ("bfloat16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        ("float8_e4m3fn", torch.float8_e4m3fn),
    ],
)
def test_accepted_values(cls, given, expected):
    opt = cls([torch.nn.Parameter(torch.zeros(3))], exact_step_dtype=given)
    assert opt.exact_step_dtype == expected


@pytest.mark.parametrize("bad", [torch.float16, "fp16", "bf16", torch.int8, 16, torch.float8_e5m2])
def test_other_values_are_refused_with_the_choices(bad):
    with pytest.raises(ValueError, match=r"torch\.float32, torch\.bfloat16 or torch\.float8_e4m3fn"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(3))], exact_step_dtype=bad)


def test_one_process_sends_nothing_and_steps_as_before():
    """Without communication the option changes nothing: the same parameters, bit for bit."""
    out = []
    for dtype in (None, "bfloat16", "float8_e4m3fn"):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = ZeroOneAdam(model.parameters(), lr=1e-2, exact_step_dtype=dtype)
        opt.set_run_length(30, 3)
        gen = torch.Generator().manual_seed(1)
        for _ in range(30):
            opt.zero_grad()
            model(torch.randn(16, 8, generator=gen)).square().mean().backward()
            opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


def test_the_trainer_flag_reaches_the_optimizer(tmp_path):
    from transformers import HfArgumentParser

    from hf_zeroone.integrations.training_args import ZeroOneTrainingArguments, build_optimizer

    parser = HfArgumentParser(ZeroOneTrainingArguments)
    base = ["--output_dir", str(tmp_path), "--optim_compression", "zeroone_adam"]
    (default,) = parser.parse_args_into_dataclasses(base)
    (full,) = parser.parse_args_into_dataclasses([*base, "--exact_step_dtype", "float32"])
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    assert build_optimizer(default, params).exact_step_dtype == torch.float8_e4m3fn  # the default
    assert build_optimizer(full, params).exact_step_dtype == torch.float32
    (bf16,) = parser.parse_args_into_dataclasses([*base, "--exact_step_dtype", "bfloat16"])
    assert build_optimizer(bf16, params).exact_step_dtype == torch.bfloat16
    with pytest.raises(SystemExit):  # argparse names the choices
        HfArgumentParser(ZeroOneTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--exact_step_dtype", "float16"]
        )


def test_the_default_is_float8_and_float32_or_none_is_full_precision():
    from hf_zeroone import OneBitAdam, ZeroOneAdam

    p = [torch.nn.Parameter(torch.zeros(2))]
    for cls in (OneBitAdam, ZeroOneAdam):
        assert cls(p).exact_step_dtype is torch.float8_e4m3fn
        assert cls(p, exact_step_dtype="bfloat16").exact_step_dtype is torch.bfloat16
        assert cls(p, exact_step_dtype="float32").exact_step_dtype is torch.float32
        assert cls(p, exact_step_dtype=None).exact_step_dtype is None  # the gradients' own precision


def test_the_trainer_and_the_benchmark_default_to_the_optimizers_default():
    """The default is written as a literal in the Trainer arguments and the benchmark CLI: they must not drift."""
    import inspect
    import sys
    from dataclasses import fields
    from pathlib import Path

    from hf_zeroone.integrations.training_args import ZeroOneTrainingArguments
    from hf_zeroone.optim._step_kind import check_exact_step_dtype

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    from bench.cli import build_parser

    default = inspect.signature(OneBitAdam).parameters["exact_step_dtype"].default
    assert inspect.signature(ZeroOneAdam).parameters["exact_step_dtype"].default is default
    trainer = next(f.default for f in fields(ZeroOneTrainingArguments) if f.name == "exact_step_dtype")
    bench = build_parser().parse_args([]).exact_step_dtype
    assert check_exact_step_dtype(trainer) is default and check_exact_step_dtype(bench) is default
