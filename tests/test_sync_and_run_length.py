"""Replicas at the end of training (``synchronize``) and the run length given where a script knows it."""

import warnings

import pytest
import torch

from hf_zeroone import OneBitAdam, ZeroOneAdam, recommended_freeze_step, recommended_local_steps

from _dist import run_ranks


def _local_phase_run(rank, world, steps):
    """0/1 Adam through the hook, stopped in the middle of a sync interval; then ``synchronize()``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    model = make_model(embedding_rows=4)
    ddp = DDP(model)
    opt = ZeroOneAdam(ddp.parameters(), lr=1e-2, var_freeze_step=6, local_step_scaler=2, local_step_clipper=8)
    register_zeroone_hook(ddp, opt)
    for x, y in batches(rank, steps):
        opt.zero_grad()
        loss_fn(ddp, x, y).backward()
        opt.step()
    out = {"kind": opt.last_step_kind.value, "in_sync_before": opt.in_sync, "before": flat_params(model)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.state_dict()
    out["warned"] = any("between two syncs" in str(w.message) for w in caught)
    sent = opt.comm_stats.bytes_sent
    out["synced"] = opt.synchronize()
    out["sent"], out["after"], out["in_sync_after"] = opt.comm_stats.bytes_sent - sent, flat_params(model), opt.in_sync
    out["again"] = opt.synchronize()  # nothing left to do
    for x, y in batches(rank, 6, seed=300):  # training goes on from the synced point
        opt.zero_grad()
        loss_fn(ddp, x, y).backward()
        opt.step()
    out["later_finite"] = bool(torch.isfinite(flat_params(model)).all())
    return out


@pytest.mark.slow
def test_synchronize_brings_replicas_to_one_model_between_syncs():
    res = run_ranks(_local_phase_run, 2, 17, timeout=120)
    r0, r1 = res
    assert r0["kind"] == "local" and not r0["in_sync_before"]  # the run ended between two syncs
    assert not torch.equal(r0["before"], r1["before"])  # the replicas had drifted apart
    assert r0["warned"]  # a checkpoint taken there says so
    assert r0["synced"] and r0["sent"] > 0 and r0["in_sync_after"]
    assert torch.equal(r0["after"], r1["after"])  # bit-identical after the sync
    assert not r0["again"] and r0["later_finite"]


def _onebit_is_always_in_sync(rank, world):
    from _workloads import batches, loss_fn, make_model

    model = make_model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    for x, y in batches(rank, 4):
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return opt.in_sync, opt.synchronize()


@pytest.mark.slow
def test_one_bit_adam_replicas_need_no_sync():
    assert run_ranks(_onebit_is_always_in_sync, 2, timeout=60)[0] == (True, False)


# ------------------------------------------------------------------------------------------------ run length
def test_set_run_length_derives_what_was_not_given():
    p = [torch.nn.Parameter(torch.zeros(3))]
    onebit = OneBitAdam(p, lr=1e-3)
    onebit.set_run_length(1000, warmup_steps=50)
    assert onebit.freeze_step == recommended_freeze_step(1000, 50) == 300
    zo = ZeroOneAdam(p, lr=1e-3, local_step_scaler=7)
    zo.set_run_length(400, warmup_steps=40)
    assert zo.var_freeze_step == recommended_freeze_step(400, 80) == 120
    assert zo.local_step_clipper == recommended_local_steps(400, 120)["local_step_clipper"] == 4
    assert zo.local_step_scaler == 7  # given: kept
    assert zo.exact_warmup_steps == zo.var_freeze_step == 120  # not given: all of phase 1
    given = OneBitAdam(p, lr=1e-3, freeze_step=30)
    given.set_run_length(1000, warmup_steps=50)
    assert given.freeze_step == 30


def test_set_run_length_after_the_first_step_is_refused():
    p = torch.nn.Parameter(torch.ones(3))
    opt = ZeroOneAdam([p], lr=1e-3)
    p.grad = torch.ones(3)
    opt.step()
    with pytest.raises(ValueError, match="before the first step"):
        opt.set_run_length(100)
    with pytest.raises(ValueError, match="num_training_steps"):
        OneBitAdam([p], lr=1e-3).set_run_length(0)


@pytest.mark.parametrize("cls, first", [(OneBitAdam, 100), (ZeroOneAdam, 200)])
def test_a_warm_up_longer_than_the_run_warns_that_nothing_is_compressed(cls, first):
    """set_run_length(10, 100) put the freeze after the run: no step compressed, and nothing said so."""
    with pytest.warns(UserWarning, match=f"first compressed step would be step {first}, not before the end of the run"):
        cls([torch.nn.Parameter(torch.ones(3))]).set_run_length(10, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls([torch.nn.Parameter(torch.ones(3))]).set_run_length(1000, 100)  # a run that compresses: silent
        # the paper's 0/1 Adam: 1-bit gradients from step 1 of phase 1, however late the freeze
        ZeroOneAdam([torch.nn.Parameter(torch.ones(3))], var_freeze_step=100, exact_warmup_steps=0).set_run_length(50)


def _first_step_warning(rank, world, set_length):
    from _workloads import batches, loss_fn, make_model

    model = make_model()
    opt = ZeroOneAdam(model.parameters(), lr=1e-2)
    if set_length:
        opt.set_run_length(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(rank, 4):
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
    return [str(w.message) for w in caught if "run length" in str(w.message)], opt.comm_stats.compressed_allreduces


@pytest.mark.slow
def test_an_optimizer_never_told_its_run_length_warns_once_naming_the_fix():
    (unset, compressed), _ = run_ranks(_first_step_warning, 2, False, timeout=60)
    assert len(unset) == 1 and "set_run_length" in unset[0] and "100000" in unset[0]
    assert compressed == 0  # no compression within 100000 steps
    (told, compressed), _ = run_ranks(_first_step_warning, 2, True, timeout=60)
    assert told == [] and compressed > 0
