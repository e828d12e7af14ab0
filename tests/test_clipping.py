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
