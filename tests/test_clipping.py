"""Gradient clipping in 1-bit Adam's compression phase: what a user sees on 2 gloo ranks."""

import pytest
import torch

from _dist import run_ranks

FREEZE, STEPS, SPIKE_AT = 15, 80, 50


def _train(rank, world, clip, spike):
    """Train the shared MLP task with the hook; optionally clip at 1.0 and spike rank 1's gradient."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, eval_loss, flat_params, loss_fn, make_model

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    opt = OneBitAdam(ddp.parameters(), lr=3e-3, freeze_step=FREEZE)
    register_zeroone_hook(ddp, opt)
    norms, moves = [], []
    for step, (x, y) in enumerate(batches(rank, STEPS)):
        opt.zero_grad()
        loss = loss_fn(ddp, x, y)
        if spike and step == SPIKE_AT and rank == 1:
            loss = loss * 1e4  # one bad batch on one rank
        loss.backward()
        before = flat_params(model)
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0 if clip else float("inf"))
        opt.step()
        norms.append(float(norm))
        moves.append(float((flat_params(model) - before).abs().max()))
    return {"eval": eval_loss(model, world), "norms": norms, "moves": moves, "flat": flat_params(model)}


@pytest.fixture(scope="module")
def runs():
    return {
        (clip, spike): run_ranks(_train, 2, clip, spike, timeout=180)
        for clip, spike in ((False, False), (True, False), (True, True))
    }


@pytest.mark.slow
def test_the_norm_clipping_sees_stays_gradient_sized_after_compression_starts(runs):
    norms = torch.tensor(runs[(False, False)][0]["norms"])
    warmup, compressed = norms[5:FREEZE].median(), norms[FREEZE:].median()
    assert compressed < 2 * warmup, (warmup, compressed)  # the implied gradient alone: 10-20x


@pytest.mark.slow
def test_clipping_at_one_learns_as_well_as_no_clipping(runs):
    free, clipped = runs[(False, False)], runs[(True, False)]
    assert torch.equal(clipped[0]["flat"], clipped[1]["flat"])
    assert clipped[0]["eval"] < 1.05 * free[0]["eval"], (clipped[0]["eval"], free[0]["eval"])


@pytest.mark.slow
def test_a_one_step_spike_on_one_rank_is_contained(runs):
    calm, spiked = runs[(True, False)][0], runs[(True, True)][0]
    typical = torch.tensor(calm["moves"][FREEZE:]).median()
    assert spiked["moves"][SPIKE_AT] < 3 * typical, (spiked["moves"][SPIKE_AT], typical)
    assert spiked["eval"] < 1.1 * calm["eval"], (spiked["eval"], calm["eval"])


def _seen_over_averaged_norm(rank, world, name, follow_gradient_scale):
    """Per step of the kinds below, the norm clipping sees, over the norm of the exactly averaged gradient.

    1-bit Adam's momentum steps, 0/1 Adam's local and sync steps (whose ranks step on their own
    gradients: the reference is the average of the gradients at each rank's own parameters).
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    ddp = DDP(model)
    if name == "onebit":
        opt = OneBitAdam(ddp.parameters(), lr=1e-3, freeze_step=20, follow_gradient_scale=follow_gradient_scale)
    else:
        opt = ZeroOneAdam(ddp.parameters(), lr=1e-3, var_freeze_step=20, follow_gradient_scale=follow_gradient_scale)
    register_zeroone_hook(ddp, opt)
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(100 + rank)
    ratios = []
    for _ in range(60):
        x = torch.randn(4, 64, generator=gen)
        y = x @ w.T + 3.0 * torch.randn(4, 8, generator=gen)  # small noisy batches: local gradients mostly noise
        local = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), list(model.parameters()))
        averaged = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(averaged)
        averaged /= world
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        seen = torch.nn.utils.clip_grad_norm_(ddp.parameters(), float("inf"))
        opt.step()
        if opt.last_step_kind.value in ("onebit_momentum", "local", "onebit_sync"):
            ratios.append(float(seen / averaged.norm()))
    return ratios


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_clipping_sees_about_the_averaged_gradients_norm_as_with_adamw(name):
    """Not the local gradients' larger norm: that clipped where AdamW did not (CLM: 1-bit +1.3%, 0/1 Adam +1.4%).

    1-bit Adam hands on an implied gradient scaled to the estimate; 0/1 Adam's local steps their
    local gradients, divided by the square root of the noise excess.
    """
    ours = torch.tensor(run_ranks(_seen_over_averaged_norm, 2, name, True, timeout=180)[0]).median()
    assert 0.8 < ours < 1.2, ours
    # without the noise excess (follow_gradient_scale off, which measures it) the local norms show
    local = torch.tensor(run_ranks(_seen_over_averaged_norm, 2, name, False, timeout=180)[0]).median()
    assert local > 1.25, local
