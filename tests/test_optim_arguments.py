"""The optimizers refuse bad hyperparameters, parameter groups and parameters with a clear error."""

import pytest
import torch

from hf_zeroone import OneBitAdam, ZeroOneAdam


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr must be"),
        (dict(betas=(1.0, 0.9)), r"betas\[0\]"),
        (dict(betas=(0.9, -0.1)), r"betas\[1\]"),
        (dict(betas=0.9), "betas must be a pair"),
        (dict(eps=-1e-8), "eps must be"),
        (dict(weight_decay=-0.1), "weight_decay must be"),
        (dict(amsgrad=True), "amsgrad"),
        (dict(maximize=True), "negated objective"),
        (dict(capturable=True), "capturable"),
        (dict(differentiable=True), "differentiable"),
    ],
)
@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_bad_common_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize(
    "group, match",
    [
        (dict(lr=-1.0), "lr must be"),
        (dict(lr=torch.tensor(0.01)), "lr must be a float"),  # failed in 0/1 Adam's first sync, half-applied
        (dict(betas=(1.5, 0.999)), r"betas\[0\]"),
        (dict(eps="x"), "eps must be"),
        (dict(weight_decay=-0.1), "weight_decay must be"),
    ],
)
@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_a_parameter_group_is_checked_as_the_constructor_checks(cls, group, match):
    """Groups were accepted as they came; a bad one trained silently or failed in the middle of a step."""
    with pytest.raises(ValueError, match=f"in a parameter group, {match}"):
        cls([{"params": [torch.nn.Parameter(torch.zeros(2))], **group}])
    opt = cls([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=f"in a parameter group, {match}"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], **group})
    assert len(opt.param_groups) == 1  # refused, not added


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (OneBitAdam, dict(freeze_step=-1), "freeze_step must be an integer >= 1"),
        (OneBitAdam, dict(freeze_step=2.5), "freeze_step must be an integer"),
        (ZeroOneAdam, dict(var_freeze_step=-3), "var_freeze_step"),
        (ZeroOneAdam, dict(var_update_scaler=0), "var_update_scaler must be an integer >= 1"),
        (ZeroOneAdam, dict(local_step_scaler=0), "local_step_scaler"),
        (ZeroOneAdam, dict(local_step_clipper=0), "local_step_clipper"),
        (ZeroOneAdam, dict(exact_warmup_steps=-1), "exact_warmup_steps"),
    ],
)
def test_bad_schedule_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_unsupported_parameters_are_refused():
    with pytest.raises(ValueError, match="complex"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="exp_avg_mask must be a tensor"):
        OneBitAdam([{"params": [torch.nn.Parameter(torch.zeros(2))], "exp_avg_mask": [1, 0]}])
