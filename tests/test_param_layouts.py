"""Parameters whose memory order is not row-major: a transposed weight, a ``channels_last`` convolution.

DDP keeps such a parameter's gradient in its bucket in the parameter's own memory order and reads
the hook's result back that way, but ``GradBucket.gradients()`` views every gradient row-major
(torch 2.13). Before the fix the hook built its 1-bit messages from those views: a transposed
weight's gradient, transposed. 1-bit Adam's hook path then diverged on a model where ``step()``
and AdamW trained (late loss 52,980 against 5.6 on a linear regression), and 0/1 Adam's exact
steps measured their scale samples against the wrong elements' variance.
"""

import pytest
import torch

from _dist import run_ranks

STEPS = 40


def _optimizer(name, params):
    from hf_zeroone import OneBitAdam, ZeroOneAdam

    if name == "adamw":
        return torch.optim.AdamW(params, lr=2e-2)
    if name == "onebit":
        return OneBitAdam(params, lr=2e-2, freeze_step=6)
    # 1-bit gradients from step 3, local steps and 1-bit syncs from step 10
    return ZeroOneAdam(params, lr=2e-2, var_freeze_step=10, exact_warmup_steps=2, local_step_scaler=2)


class _Model(torch.nn.Module):
    def __init__(self, strided: bool, conv: bool):
        super().__init__()
        torch.manual_seed(0)
        weight = torch.randn(16, 4) * 0.3
        self.w = torch.nn.Parameter(weight.t().contiguous().t() if strided else weight)  # strides (1, 16)
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1) if conv else None
        if conv and strided:
            self.conv.to(memory_format=torch.channels_last)

    def forward(self, x):
        out = x @ self.w
        if self.conv is not None:
            out = out + self.conv(x.view(-1, 2, 2, 4)).mean(dim=(1, 2))
        return out


def _train(rank, world_size, name, path, strided, conv):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import train_linear_target

    model = _Model(strided, conv)
    if strided:
        assert not model.w.is_contiguous()
    trained = DDP(model) if path == "hook" else model
    opt = _optimizer(name, list(model.parameters()))
    if path == "hook" and name != "adamw":
        register_zeroone_hook(trained, opt)
    losses = train_linear_target(lambda x, i: trained(x), opt, rank, STEPS)
    if name == "zeroone":
        opt.synchronize()
    return {"late": sum(losses[-10:]) / 10, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_transposed_weight_gets_the_same_steps_through_the_hook_as_through_step(name):
    """One parameter (one bucket, the same order on both paths): the two paths agree bit for bit."""
    hook = run_ranks(_train, 2, name, "hook", True, False)[0]
    step = run_ranks(_train, 2, name, "step", True, False)[0]
    assert all(torch.equal(a, b) for a, b in zip(hook["params"], step["params"])), (hook["late"], step["late"])


@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_transposed_and_channels_last_parameters_train_as_row_major_ones(name):
    strided = run_ranks(_train, 2, name, "hook", True, True)
    plain = run_ranks(_train, 2, name, "hook", False, True)[0]
    adamw = run_ranks(_train, 2, "adamw", "hook", True, True)[0]
    assert torch.equal(torch.cat([p.flatten() for p in strided[0]["params"]]),
                       torch.cat([p.flatten() for p in strided[1]["params"]]))  # fmt: skip
    assert strided[0]["late"] == pytest.approx(plain["late"], rel=0.1), (strided[0]["late"], plain["late"])
    assert strided[0]["late"] < 1.5 * adamw["late"], (strided[0]["late"], adamw["late"])
