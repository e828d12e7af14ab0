"""OneBitAdam and ZeroOneAdam on several gloo ranks, with and without the DDP hook."""

import math

import pytest
import torch

from _dist import run_ranks

STEPS = 200


def _opt(name, params, steps=STEPS):
    from hf_zeroone import OneBitAdam, ZeroOneAdam

    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    if name == "onebit":
        return OneBitAdam(params, lr=1e-2, weight_decay=0.01, freeze_step=steps // 10)
    return ZeroOneAdam(
        params,
        lr=1e-2,
        weight_decay=0.01,
        var_freeze_step=steps // 2,
        var_update_scaler=4,
        local_step_scaler=8,
        local_step_clipper=4,
        exact_warmup_steps=steps // 10,
    )


def _train_all(rank, world, names, steps):
    """Train each optimizer with and without the hook; record rank-identity after every step."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import StepKind
    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, eval_loss, flat_params, loss_fn, make_model

    data = batches(rank, steps)
    out = {}
    for name in names:
        for use_hook in (False, True) if name != "adamw" else (True,):
            model = make_model()
            if use_hook:
                ddp = DDP(model, bucket_cap_mb=0.004)  # several buckets
                opt = _opt(name, ddp.parameters(), steps)
                if name != "adamw":
                    register_zeroone_hook(ddp, opt)
                net = ddp
            else:
                opt = _opt(name, model.parameters(), steps)
                net = model
            kinds, snapshots = [], []
            for x, y in data:
                opt.zero_grad()
                loss_fn(net, x, y).backward()
                opt.step()
                kind = getattr(opt, "last_step_kind", StepKind.EXACT)
                kinds.append(kind.value)
                if kind is not StepKind.LOCAL:
                    snapshots.append(flat_params(model))
            out[(name, use_hook)] = {
                "kinds": kinds,
                "snapshots": torch.stack(snapshots),
                "eval": eval_loss(model, world),
                "stats": opt.comm_stats.as_dict() if name != "adamw" else None,
            }
    return out


@pytest.fixture(scope="module")
def two_rank_runs():
    return run_ranks(_train_all, 2, ["adamw", "onebit", "zeroone"], STEPS, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
@pytest.mark.parametrize("use_hook", [False, True], ids=["optimizer-path", "ddp-hook"])
def test_replicas_are_bit_identical_after_every_synchronising_step(two_rank_runs, name, use_hook):
    a, b = two_rank_runs[0][(name, use_hook)], two_rank_runs[1][(name, use_hook)]
    assert a["kinds"] == b["kinds"]
    assert torch.equal(a["snapshots"], b["snapshots"])
    assert len(a["snapshots"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
@pytest.mark.parametrize("use_hook", [False, True], ids=["optimizer-path", "ddp-hook"])
def test_converges_like_adamw(two_rank_runs, name, use_hook):
    from _workloads import eval_loss, make_model

    initial = eval_loss(make_model(), 2)
    adamw = two_rank_runs[0][("adamw", True)]["eval"]
    ours = two_rank_runs[0][(name, use_hook)]["eval"]
    assert adamw < 0.15 * initial  # the task is learnt
    # Within a few percent of AdamW, measured against how far AdamW got from the start.
    assert ours - adamw <= 0.05 * (initial - adamw), (name, use_hook, ours, adamw, initial)


@pytest.mark.slow
def test_schedules_ran_every_phase(two_rank_runs):
    kinds = two_rank_runs[0][("zeroone", True)]["kinds"]
    assert {"exact", "onebit_gradient", "onebit_sync", "local"} <= set(kinds)
    kinds = two_rank_runs[0][("onebit", True)]["kinds"]
    assert kinds.count("exact") == STEPS // 10 and kinds.count("onebit_momentum") == STEPS - STEPS // 10


@pytest.mark.slow
def test_zeroone_sends_far_less_than_onebit(two_rank_runs):
    onebit = two_rank_runs[0][("onebit", True)]["stats"]
    zeroone = two_rank_runs[0][("zeroone", True)]["stats"]
    assert zeroone["collectives"] < onebit["collectives"]


def _three_rank(rank, world):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    out = {}
    for name in ("onebit", "zeroone"):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.004)
        opt = _opt(name, ddp.parameters(), 40)
        register_zeroone_hook(ddp, opt)
        snaps = []
        for x, y in batches(rank, 40):
            opt.zero_grad()
            loss_fn(ddp, x, y).backward()
            opt.step()
            if opt.last_step_kind.communicates:
                snaps.append(flat_params(model))
        out[name] = torch.stack(snaps)
    return out


@pytest.mark.slow
def test_three_ranks_stay_identical():
    res = run_ranks(_three_rank, 3, timeout=200)
    for name in ("onebit", "zeroone"):
        assert torch.equal(res[0][name], res[1][name]) and torch.equal(res[0][name], res[2][name])


def _sync_kicks(rank, world):
    """0/1 Adam with one element whose variance is 1e-8 times the others': how far does a sync move it?"""
    import torch

    from hf_zeroone import StepKind, ZeroOneAdam

    torch.manual_seed(rank)
    p = torch.nn.Parameter(torch.zeros(64))
    # exact steps until the local phase, so nothing but the syncs is compressed
    opt = ZeroOneAdam([p], lr=1e-3, var_freeze_step=4, exact_warmup_steps=4, local_step_scaler=1, local_step_clipper=8)
    scale = torch.ones(64)
    scale[0] = 1e-4  # Adam normalises: every element's own update is about lr per step
    moves, local_moves = [], []
    for _ in range(40):
        before = p.detach().clone()
        p.grad = (1.0 + 0.1 * torch.randn(64)) * scale
        opt.step()
        move = (p.detach() - before).abs()
        if opt.last_step_kind is StepKind.ONEBIT_SYNC:
            moves.append(move)
        elif opt.last_step_kind is StepKind.LOCAL:
            local_moves.append(move)
    return {"sync_moves": torch.stack(moves), "local_moves": torch.stack(local_moves)}


def test_a_sync_moves_a_low_variance_element_no_more_than_the_others():
    """The 1-bit sync of 0/1 Adam works on the parameter displacement, not on the momentum.

    Compressed in momentum space, the element with the tiny variance would get the segment's
    momentum magnitude divided by its own tiny denominator: a kick of about 1e4 times its update.
    """
    res = run_ranks(_sync_kicks, 2, timeout=120)
    for r in res:
        sync, local = r["sync_moves"], r["local_moves"]
        assert len(sync) >= 4 and len(local) >= 4
        # a sync moves every element by at most the sync gap (8) times a few lr-sized steps
        assert sync.max().item() < 8 * 3 * 1e-3, sync.max().item()
        assert sync[:, 0].max().item() < 3 * sync[:, 1:].max().item()


def _scaler_skip_without_hook(rank, world, kind, bad_steps, amp_protocol=True, overflow="loss", unscale_first=False):
    """``step()`` communicating (no DDP) with a GradScaler; rank 1 overflows at the iterations ``bad_steps``.

    ``overflow``: ``"loss"`` (the loss times inf: inf and NaN gradients) or ``"inf"`` (every gradient
    +inf). ``unscale_first``: the user unscales and clips before ``scaler.step``. The model has an
    embedding whose rows 1.. never get a gradient (masked from the freeze on).
    """
    import warnings

    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.optim import _masks

    from _workloads import batches, loss_fn, make_model

    model = make_model(embedding_rows=10)
    if kind == "zeroone":  # syncs at 6, 7, 8, then 10; local steps between
        cls = ZeroOneAdam
        opt_kwargs = dict(
            var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4, exact_warmup_steps=0,
        )  # fmt: skip
    else:  # 1-bit momentum steps from 4
        cls, opt_kwargs = OneBitAdam, dict(freeze_step=4)
    if not amp_protocol:  # the scaler unscales and skips step() itself (as before the protocol)
        cls = type(cls.__name__, (cls,), {"_step_supports_amp_scaling": False})
    opt = cls(model.parameters(), lr=1e-2, exact_step_dtype="float32", **opt_kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    steps, losses, protocol = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(batches(rank, max(12, max(bad_steps, default=0) + 3))):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model, x, y)
            scaled = scaler.scale(loss)
            if rank == 1 and i in bad_steps and overflow == "loss":
                scaled = scaled * float("inf")
            scaled.backward()
            if rank == 1 and i in bad_steps and overflow == "inf":
                for p in model.parameters():
                    p.grad.fill_(float("inf"))
            if unscale_first:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            protocol.append(bool(getattr(opt, "_step_supports_amp_scaling", False)))
            scaler.step(opt)
            scaler.update()
            steps.append(opt.schedule["step"])
            losses.append(float(loss))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = opt.state[model.extra.weight]
    masked = int(_masks.masked_rows(state).sum()) if "momentum_mask" in state else 0
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return steps, losses, params, protocol, masked, said


@pytest.mark.parametrize(
    ("kind", "bad_step", "overflow"),
    [("zeroone", 9, "loss"), ("zeroone", 7, "loss"), ("onebit", 7, "loss"), ("onebit", 7, "inf")],
    ids=["zeroone-local", "zeroone-sync", "onebit-1bit-momentum", "onebit-1bit-momentum-inf"],
)
def test_a_gradscaler_skip_on_one_rank_without_the_hook_skips_on_every_rank(kind, bad_step, overflow):
    """A GradScaler's overflow on one rank, ``step()`` communicating: every rank skips that step.

    Before, the scaler skipped ``step()`` on the overflowing rank alone: on 0/1 Adam's local step (9)
    or sync (7) its step counter stayed one behind for good and the syncs paired iterations apart,
    with no error; on 1-bit Adam's compressed step the other rank's exchange paired with its next
    step's. Now the scaler calls ``step()`` on every rank (GradScaler's protocol) and the ranks agree.
    A plain +inf overflow would be bounded by clipping to the variance and step on: it is sent as
    NaN, which must not count as activity in the embedding's masked rows (it released all 9).
    """
    results = run_ranks(_scaler_skip_without_hook, 2, kind, {bad_step}, True, overflow, timeout=200)
    (steps0, losses0, params0, protocol0, masked0, said0), (steps1, losses1, params1, protocol1, masked1, said1) = (
        results
    )
    assert steps0 == steps1, (steps0, steps1)
    assert steps0[-1] == 11 and steps0[bad_step] == steps0[bad_step - 1], steps0  # one step skipped, on both
    assert torch.equal(params0, params1)
    assert all(map(math.isfinite, losses0 + losses1)) and losses0[-1] < losses0[0]
    assert all(protocol0) and all(protocol1)
    assert masked0 == masked1 == 9
    assert not said0 and not said1  # a scaler's skip, not a warning


def test_non_finite_results_under_a_gradscaler_warn_once_they_last():
    """Skips as scaler overflows are silent, but 20 in a row say that something else is non-finite."""
    results = run_ranks(_scaler_skip_without_hook, 2, "onebit", set(range(5, 30)), True, "loss", timeout=200)
    for steps, _, params, _, _, said in results:
        assert steps[-1] == 5 + (len(steps) - 30)  # none taken from the 6th step to the 30th
        assert len(said) == 1 and "20 steps in a row" in said[0], said
        assert torch.isfinite(params).all()


@pytest.mark.parametrize("unscale_first", [False, True], ids=["scaler-unscales", "user-unscales-and-clips"])
def test_a_gradscaler_unscaling_in_step_gives_the_scalers_own_unscaling_bits(unscale_first):
    """With no overflow, the protocol changes no bit of a run (``step()`` unscales, or the user did)."""
    protocol = run_ranks(_scaler_skip_without_hook, 2, "zeroone", set(), True, "loss", unscale_first, timeout=200)
    scaler_side = run_ranks(_scaler_skip_without_hook, 2, "zeroone", set(), False, "loss", unscale_first, timeout=200)
    for (steps, losses, params, used, *_), (steps_b, losses_b, params_b, used_b, *_) in zip(protocol, scaler_side):
        assert steps == steps_b == list(range(1, 13))
        assert losses == losses_b and torch.equal(params, params_b)
        assert all(used) and not any(used_b)
