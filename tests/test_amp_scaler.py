"""The GradScaler protocol's helpers (``hf_zeroone/optim/_amp_scaler.py``), in one process."""

import pytest
import torch

from hf_zeroone import OneBitAdam
from hf_zeroone.optim._amp_scaler import unscale_gradients


def test_unscaling_divides_as_the_scaler_does_and_refuses_fp16_gradients_as_it_does():
    p = torch.nn.Parameter(torch.zeros(5))
    p.grad = torch.tensor([3.0, -1.0, 0.5, 1e-30, 7.0])
    want = p.grad.clone()
    torch._amp_foreach_non_finite_check_and_unscale_([want], torch.zeros(()), torch.tensor(1 / 384.0))
    unscale_gradients([p], torch.tensor(384.0))
    assert torch.equal(p.grad, want)
    unscale_gradients([p], None)  # already unscaled by the user: unchanged
    assert torch.equal(p.grad, want)

    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    half.grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp16 gradients"):
        unscale_gradients([p, half], torch.tensor(2.0))
    assert torch.equal(half.grad, torch.ones(3, dtype=torch.float16))  # nothing touched


def test_in_one_process_the_scaler_keeps_skipping_step_itself():
    model = torch.nn.Linear(4, 1)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    assert opt._step_supports_amp_scaling is False  # the protocol is for several ranks without the hook
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    steps = []
    for i in range(4):
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).sum() * (float("inf") if i == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        steps.append(opt.schedule["step"])
    assert steps == [1, 1, 2, 3] and scaler.get_scale() == 128.0
