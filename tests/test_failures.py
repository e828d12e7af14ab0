"""Failures on several gloo ranks: skipped steps, failed communication jobs, non-finite syncs, overflow."""

import pytest
import torch

from _dist import run_ranks


def _skip_then_no_sync(rank, world, name):
    """A step skipped after the hook ran (GradScaler-style), then an iteration entirely under no_sync()."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    model = make_model()
    ddp = DDP(model)
    if name == "onebit":
        opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=2)
    else:
        opt = ZeroOneAdam(ddp.parameters(), lr=1e-2, var_freeze_step=100)
    register_zeroone_hook(ddp, opt)
    data = batches(rank, 6)
    for x, y in data[:4]:
        opt.zero_grad()
        loss_fn(ddp, x, y).backward()
        opt.step()
    x, y = data[4]
    loss_fn(ddp, x, y).backward()  # the hook runs ...
    model.zero_grad()  # ... but the step is skipped; the loop clears gradients through the model
    x, y = data[5]
    with ddp.no_sync():  # every micro-step of the next iteration without the hook
        loss_fn(ddp, x, y).backward()
    opt.step()  # must communicate itself
    return flat_params(model)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_after_a_skipped_step_local_gradients_are_not_taken_for_combined_ones(name):
    res = run_ranks(_skip_then_no_sync, 2, name, timeout=120)
    assert torch.equal(res[0], res[1])


def _failing_job(rank, world):
    import time

    import torch

    import hf_zeroone._two_stage as comm_module
    from hf_zeroone.comm import Communicator
    from hf_zeroone.compression import ChunkLayout

    comm = Communicator()
    layout = ChunkLayout.from_mask(64, world, None, torch.device("cpu"))
    errors = (torch.zeros(layout.padded), torch.zeros(layout.chunk))
    if rank == 1:  # in the server's sum of its chunk (with or without the fused CPU kernels)
        real = comm_module._server_sum

        def fail_once(*args, **kwargs):
            comm_module._server_sum = real
            raise RuntimeError("injected failure between the all-to-all and the all-gather")

        comm_module._server_sum = fail_once
    outcome = []
    for _ in range(2):
        start = time.monotonic()
        try:
            comm.compressed_allreduce(torch.ones(layout.padded), *errors, layout)
            outcome.append(("ok", "", time.monotonic() - start))
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            outcome.append((type(exc).__name__, str(exc), time.monotonic() - start))
    return outcome


@pytest.mark.slow
def test_a_failed_job_stops_the_communicator_instead_of_pairing_wrong_collectives():
    res = run_ranks(_failing_job, 2, timeout=90, collective_timeout=4)
    (first1, msg1, _), (second1, again1, t1) = res[1]
    assert first1 != "ok" and "injected failure" in msg1
    assert second1 == "RuntimeError" and "refuses all further work" in again1 and "injected failure" in again1
    assert t1 < 2.0  # refused at once, not after a timeout
    (first0, _, _), (second0, again0, t0) = res[0]
    assert first0 != "ok"  # the peer ended at its collective timeout
    assert second0 == "RuntimeError" and "refuses all further work" in again0 and t0 < 2.0


def _non_finite_sync(rank, world):
    import warnings

    import torch

    from hf_zeroone import StepKind, ZeroOneAdam

    p = torch.nn.Parameter(torch.ones(40))
    opt = ZeroOneAdam([p], lr=1e-2, var_freeze_step=3, var_update_scaler=1, local_step_scaler=100)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        p.grad = torch.randn(40, generator=g)
        opt.step()
    synced = p.detach().clone()
    assert opt.next_step_kind() is StepKind.ONEBIT_SYNC
    if rank == 1:
        with torch.no_grad():
            p[7] = float("inf")  # an overflowing local update (u is derived from p and the synced parameters)
    p.grad = torch.randn(40, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    after = p.detach().clone()
    for _ in range(3):
        p.grad = torch.randn(40, generator=g)
        opt.step()
    return {
        "warned": any("discarded on all ranks" in str(w.message) for w in caught),
        "back_to_sync": torch.equal(after, synced),
        "after": after,
        "end": p.detach().clone(),
    }


@pytest.mark.slow
def test_a_non_finite_sync_on_one_rank_is_discarded_by_every_rank():
    res = run_ranks(_non_finite_sync, 2, timeout=60)
    for r in res:
        assert r["warned"] and r["back_to_sync"]
        assert torch.isfinite(r["end"]).all()
    assert torch.equal(res[0]["after"], res[1]["after"]) and torch.equal(res[0]["end"], res[1]["end"])


def _fp16_mean(rank, world):
    import torch

    from hf_zeroone.comm import Communicator

    comm = Communicator()
    return comm.allreduce_mean(torch.full((4,), 40000.0, dtype=torch.float16))


@pytest.mark.slow
def test_the_exact_mean_of_large_fp16_values_does_not_overflow():
    res = run_ranks(_fp16_mean, 2, timeout=60)
    for out in res:  # 40000 + 40000 overflows fp16 (max 65504); 20000 + 20000 does not
        assert torch.equal(out, torch.full((4,), 40000.0, dtype=torch.float16))


def _warning_locations(rank, world):
    import inspect
    import warnings

    import torch
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from hf_zeroone import OneBitAdam

    from _workloads import batches, loss_fn, make_model

    Accelerator(cpu=True)  # AcceleratedOptimizer needs the accelerate state
    lines = {}
    for how in ("plain", "lr_scheduler", "accelerate"):
        model = make_model()
        opt = OneBitAdam(model.parameters(), freeze_step=2)
        if how == "lr_scheduler":
            torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # wraps opt.step
        stepper = AcceleratedOptimizer(opt, device_placement=False) if how == "accelerate" else opt
        x, y = batches(rank, 1)[0]
        loss_fn(model, x, y).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            stepper.step()
        hits = [w for w in caught if "no hf_zeroone DDP hook" in str(w.message)]
        lines[how] = [(w.filename == __file__, w.lineno == line) for w in hits]
    return lines


@pytest.mark.slow
def test_the_no_hook_warning_points_at_the_users_line():
    for how, hits in run_ranks(_warning_locations, 2, timeout=120)[0].items():
        assert hits == [(True, True)], how


def _register_misuse(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import make_model

    ddp = DDP(make_model())
    opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=2)
    out = []
    try:
        register_zeroone_hook(ddp, opt, grad_scaler="yes")
    except TypeError as exc:
        out.append(str(exc))
    register_zeroone_hook(ddp, opt)  # the refused call registered nothing
    try:
        register_zeroone_hook(ddp, opt)
    except RuntimeError as exc:
        out.append(str(exc))
    return out


def test_registering_the_hook_twice_or_with_a_wrong_scaler_says_what_is_wrong():
    """A second hook gave DDP's own error; a scaler of the wrong type failed at the first backward."""
    (said,) = run_ranks(_register_misuse, 1, timeout=60)
    assert said[0] == "grad_scaler must be a torch.amp.GradScaler or None, got str"
    assert "has a communication hook already" in said[1] and "once per model" in said[1]
