"""Faults, bad input and safe loading: each protection has a test that fails without it."""

import pickle
import time

import pytest
import torch

from _dist import run_ranks


def _drift(rank, world):
    """A replica that silently changes is caught by the opt-in check, on every rank."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, loss_fn, make_model

    out = {}
    # Through every 0/1 Adam phase with the hook: no false alarm.
    model = make_model()
    ddp = DDP(model)
    opt = ZeroOneAdam(
        ddp.parameters(), lr=1e-2, var_freeze_step=6, var_update_scaler=1, local_step_scaler=2,
        local_step_clipper=4, check_replicas_every=1,
    )  # fmt: skip
    register_zeroone_hook(ddp, opt)
    for x, y in batches(rank, 20):
        opt.zero_grad()
        loss_fn(ddp, x, y).backward()
        opt.step()
    out["clean_steps"] = opt.schedule["step"]

    # Now one rank's weights change behind the optimizer's back.
    model = make_model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, check_replicas_every=1)
    out["error"] = None
    for i, (x, y) in enumerate(batches(rank, 6)):
        if i == 3 and rank == 1:
            with torch.no_grad():
                model.body[0].weight[0, 0] += 1e-6
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        try:
            opt.step()
        except RuntimeError as exc:
            out["error"] = (i, str(exc))
            break
    return out


@pytest.mark.slow
def test_replica_drift_is_detected_on_every_rank():
    res = run_ranks(_drift, 2, timeout=200)
    for r in res:
        assert r["clean_steps"] == 20
        step, message = r["error"]
        assert step == 3 and "differ between ranks" in message and "[1]" in message


def _skipped_step(rank, world, which, skip_at, passes=130, check_every=None):
    """Default settings through the DDP hook (or check_replicas_every=check_every); rank 1 skips step ``skip_at``."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, loss_fn, make_model

    kwargs = {} if check_every is None else {"check_replicas_every": check_every}
    model = make_model()
    net = DDP(model)
    if which == "onebit":
        opt = OneBitAdam(net.parameters(), lr=1e-2, freeze_step=4, **kwargs)
    else:  # into the local phase, where replicas differ between syncs by design
        opt = ZeroOneAdam(
            net.parameters(), lr=1e-2, var_freeze_step=6, var_update_scaler=1, local_step_scaler=2,
            local_step_clipper=4, **kwargs,
        )  # fmt: skip
    register_zeroone_hook(net, opt)
    in_sync, check = [], opt.check_replicas
    opt.check_replicas = lambda when: (in_sync.append(opt.in_sync), check(when))[1]  # which branch each check took
    warnings.simplefilter("ignore")
    error = None
    for i, (x, y) in enumerate(batches(rank, passes)):
        opt.zero_grad()
        try:
            loss_fn(net, x, y).backward()
            if i == skip_at and rank == 1:
                continue  # e.g. a loss found non-finite on this rank alone
            opt.step()
        except RuntimeError as exc:
            error = (i, str(exc))
            break
    stats = opt.comm_stats
    return error, (stats.bytes_sent, stats.collectives), (stats.check_bytes, stats.check_collectives), in_sync


@pytest.mark.slow
def test_a_rank_that_skips_a_step_stops_the_run_by_default():
    # Before check_replicas_every defaulted to 100 this run trained to the end with replicas whose
    # bits differed from iteration 8 on, and no error said so.
    res = run_ranks(_skipped_step, 2, "onebit", 8, timeout=300)
    for error, _, checks, _ in res:
        assert error is not None, "the drift went unnoticed"
        step, message = error
        # on every rank at the same backward pass, the 100th, whatever each rank's step counter says
        assert step == 99 and "at backward pass 100 (DDP hook) differ between ranks" in message, message
        assert "step counters differ (rank 0 at 99, rank 1 at 98)" in message, message
        assert "step() skipped after backward() on one rank" in message and "check_replicas_every" in message
        assert checks == (24, 1)  # one 24-byte all-gather, counted apart from the training's traffic


@pytest.mark.slow
@pytest.mark.parametrize("which", ["onebit", "zeroone"])
def test_the_default_replica_check_finds_nothing_in_a_sound_run_and_leaves_the_traffic_alone(which):
    res = run_ranks(_skipped_step, 2, which, -1, 230, timeout=300)
    off = run_ranks(_skipped_step, 2, which, -1, 230, 0, timeout=300)
    for (error, training, checks, in_sync), (_, training_off, checks_off, _) in zip(res, off):
        assert error is None, error
        assert checks == (48, 2) and checks_off == (0, 0)  # backward passes 100 and 200
        assert training == training_off  # the bytes and collectives the docs pin are the training's alone
        # 0/1 Adam is between two syncs of its local phase at both: the parameters of the last sync compared
        assert in_sync == ([True, True] if which == "onebit" else [False, False]), in_sync


def _hang(rank, world):
    from hf_zeroone.comm import Communicator
    from hf_zeroone.compression import ChunkLayout

    comm = Communicator()
    layout = ChunkLayout.from_mask(100, world)
    if rank == 1:
        time.sleep(12)  # this rank stops entering collectives
        return {"error": None, "elapsed": 0.0}
    start = time.monotonic()
    try:
        comm.compressed_allreduce(
            torch.zeros(layout.padded), torch.zeros(layout.padded), torch.zeros(layout.chunk), layout
        )
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "elapsed": time.monotonic() - start}


@pytest.mark.slow
def test_a_missing_rank_ends_in_an_error_within_the_timeout():
    res = run_ranks(_hang, 2, timeout=90, collective_timeout=3)
    assert res[0]["error"] is not None, "the collective returned although rank 1 never joined"
    assert res[0]["elapsed"] < 10, res[0]  # timeout is 3 s: an error, not a hang


def _nonfinite_fp32(rank, world, name):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    if name == "onebit":
        opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=2)
    else:
        opt = ZeroOneAdam(ddp.parameters(), lr=1e-2, var_freeze_step=100, var_update_scaler=1)
    register_zeroone_hook(ddp, opt)
    record = []
    for i, (x, y) in enumerate(batches(rank, 10)):
        opt.zero_grad()
        loss = loss_fn(ddp, x, y)
        if rank == 1 and i in (1, 5):
            loss = loss * float("nan")
        loss.backward()
        before = opt.schedule["step"]
        opt.step()
        state_finite = all(
            bool(torch.isfinite(t).all()) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        )
        record.append((opt.schedule["step"] - before, state_finite, flat_params(model)))
    return record


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_nan_gradient_on_one_rank_is_skipped_by_all(name):
    res = run_ranks(_nonfinite_fp32, 2, name, timeout=200)
    for (adv0, fin0, p0), (adv1, fin1, p1) in zip(res[0], res[1]):
        assert adv0 == adv1 and fin0 and fin1
        assert torch.equal(p0, p1)
    assert [r[0] for r in res[0]].count(0) == 2  # steps 1 and 5 skipped, on both ranks
    assert torch.isfinite(res[0][-1][2]).all()


def _sparse(rank, world):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    ddp = DDP(model)
    try:
        register_zeroone_hook(ddp, OneBitAdam(ddp.parameters()))
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_sparse_gradients_are_refused_before_training():
    res = run_ranks(_sparse, 2, timeout=120)
    assert all(r is not None and "sparse=False" in r for r in res)


def _edge_shapes(rank, world):
    import torch

    from hf_zeroone import ZeroOneAdam

    torch.manual_seed(0)
    scalar = torch.nn.Parameter(torch.tensor(1.0))
    empty = torch.nn.Parameter(torch.zeros(0, 3))
    odd = torch.nn.Parameter(torch.randn(7, 3))
    frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    late = torch.nn.Parameter(torch.randn(5))
    opt = ZeroOneAdam(
        [scalar, empty, odd, frozen],
        lr=0.05,
        var_freeze_step=4,
        var_update_scaler=1,
        local_step_scaler=1000,  # every local-phase step syncs, so the final parameters agree
        check_replicas_every=1,
    )
    g = torch.Generator().manual_seed(rank)
    for step in range(10):
        if step == 2:
            opt.add_param_group({"params": [late], "lr": 0.01})
        noise = torch.randn(7, 3, generator=g)
        loss = (scalar - 3) ** 2 + empty.sum() + ((odd - noise) ** 2).sum() + (late**2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([scalar.detach().reshape(1), odd.detach().flatten(), late.detach(), frozen.detach()])


@pytest.mark.slow
def test_edge_shapes_on_three_ranks():
    res = run_ranks(_edge_shapes, 3, timeout=200)
    assert torch.equal(res[0], res[1]) and torch.equal(res[0], res[2])
    assert torch.equal(res[0][-4:], torch.ones(4))  # frozen stays
    assert res[0][0] > 1.0  # the scalar moved towards 3


class _Evil:
    def __reduce__(self):
        return (print, ("this would run arbitrary code",))


def test_checkpoint_with_a_pickled_object_is_refused(tmp_path):
    pytest.importorskip("transformers")
    from hf_zeroone import ZeroOneTrainer, ZeroOneTrainingArguments

    from _hf import TokenParityDataset, tiny_bert

    args = ZeroOneTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1)
    trainer = ZeroOneTrainer(model=tiny_bert(), args=args, train_dataset=TokenParityDataset(n=8))
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"state": {}, "param_groups": [], "hf_zeroone": _Evil()}, ckpt / "hf_zeroone_optimizer_rank0.pt")
    with pytest.raises(pickle.UnpicklingError):
        trainer._load_optimizer_and_scheduler(str(ckpt))
    # and a genuine optimizer checkpoint loads with weights_only=True
    torch.save(trainer.optimizer.state_dict(), ckpt / "hf_zeroone_optimizer_rank0.pt")
    trainer._load_optimizer_and_scheduler(str(ckpt))


def test_check_replicas_every_is_validated():
    from hf_zeroone import OneBitAdam

    with pytest.raises(ValueError, match="check_replicas_every must be an integer >= 0"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(1))], check_replicas_every=-1)


def test_bit_checksum_sees_one_flipped_bit_and_swaps():
    from hf_zeroone.comm import bit_checksum

    a, b = torch.randn(100), torch.randn(3, dtype=torch.bfloat16)
    base = bit_checksum([a, b])
    a2 = a.clone()
    a2.view(torch.int32)[17] ^= 1
    assert not torch.equal(bit_checksum([a2, b]), base)
    x, y = torch.randn(4), torch.randn(4)
    assert not torch.equal(bit_checksum([x, y]), bit_checksum([y, x]))
    assert torch.equal(bit_checksum([a, b]), base)


def _torchrun(out_dir, kill_at, restarts, timeout=400):
    """Run the restart script under torchrun; returns each rank's result.

    One retry, with a fresh folder, when gloo fails to *form* the process group ("connectFullMesh
    ... Connection refused"): torchelastic restarts occasionally hand a rank a stale peer address
    (seen about once in five runs on this machine, in process-group setup, before any package
    code runs). Any other failure fails the test at once.
    """
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "trainer_restart.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for attempt in range(2):
        run_dir = Path(f"{out_dir}_{attempt}")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--max-restarts", str(restarts), "--monitor-interval", "1", str(script), str(run_dir), str(kill_at),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if proc.returncode == 0 or "connectFullMesh" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return [json.loads((run_dir / f"result_rank{r}.json").read_text()) for r in range(2)], proc


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_exactly(tmp_path):
    pytest.importorskip("transformers")
    reference, _ = _torchrun(str(tmp_path / "ref"), 0, restarts=0)
    restarted, proc = _torchrun(str(tmp_path / "run"), 10, restarts=1)
    assert sorted(r["rank"] for r in restarted) == [0, 1], proc.stderr[-3000:]
    ref = {r["rank"]: r for r in reference}
    for r in restarted:
        assert r["attempt"] == 1 and r["resumed_from"].endswith("checkpoint-8")
        assert r["global_step"] == 16
        assert r["schedule"] == ref[r["rank"]]["schedule"]  # counters intact, no reset to warm-up
        assert r["checksum"] == ref[r["rank"]]["checksum"]  # continues exactly where it was
