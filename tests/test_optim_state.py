"""Single-process state handling: schedules in checkpoints, re-entering phases, skipped syncs, dtypes."""

import io
import warnings

import pytest
import torch

from hf_zeroone import OneBitAdam, StepKind, ZeroOneAdam


def _zeroone(params, **kw):
    base = dict(lr=1e-2, var_freeze_step=4, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)
    base.update(kw)
    return ZeroOneAdam(params, **base)


def _run(p, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize(
    "cls, kwargs",
    [(OneBitAdam, dict(freeze_step=0)), (ZeroOneAdam, dict(var_freeze_step=0))],
)
def test_a_zero_freeze_step_is_refused_with_the_reason(cls, kwargs):
    with pytest.raises(ValueError, match="never estimated"):
        cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize(
    "cls, saved, resumed",
    [
        (ZeroOneAdam, dict(var_freeze_step=4), dict(var_freeze_step=100)),
        (ZeroOneAdam, dict(local_step_clipper=4), dict(local_step_clipper=8)),
        (OneBitAdam, dict(freeze_step=3), dict(freeze_step=5)),
    ],
)
def test_a_checkpoint_with_another_schedule_is_refused(cls, saved, resumed):
    make = _zeroone if cls is ZeroOneAdam else (lambda ps, **kw: OneBitAdam(ps, lr=1e-2, **kw))
    p = torch.nn.Parameter(torch.ones(8))
    opt = make([p], **saved)
    _run(p, opt, 10)
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    sd = torch.load(blob, weights_only=True)
    q = torch.nn.Parameter(p.detach().clone())
    fresh = make([q], **resumed)
    name = next(iter(resumed))
    with pytest.raises(ValueError, match=rf"{name}: checkpoint {saved[name]}, this optimizer {resumed[name]}"):
        fresh.load_state_dict(sd)
    assert fresh.schedule["step"] == 0  # nothing loaded
    make([q], **saved).load_state_dict(sd)  # the same schedule loads


def _saved(opt):
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)


def test_exact_phase_1_loads_whether_it_was_given_or_derived():
    """exact_warmup_steps=None is all of phase 1: a checkpoint of it loads into an optimizer that derived it."""
    p = torch.nn.Parameter(torch.ones(8))
    local = dict(local_step_scaler=7, local_step_clipper=1)  # what set_run_length(100, 10) derives
    opt = ZeroOneAdam([p], lr=1e-2, var_freeze_step=30, **local)  # no run length: exact_warmup_steps stays None
    _run(p, opt, 5)
    derived = ZeroOneAdam([torch.nn.Parameter(torch.ones(8))], lr=1e-2, local_step_scaler=7)
    derived.set_run_length(100, warmup_steps=10)  # var_freeze_step 30, exact_warmup_steps 30
    derived.load_state_dict(_saved(opt))
    assert derived.schedule["step"] == 5


def test_a_checkpoint_of_the_old_exact_warmup_meaning_is_refused_until_told():
    """Before, exact_warmup_steps=None meant "while the learning rate rises"; it cannot resume silently."""
    p = torch.nn.Parameter(torch.ones(8))
    opt = _zeroone([p], var_freeze_step=30)
    _run(p, opt, 5)
    sd = _saved(opt)
    sd["hf_zeroone"]["hyperparameters"]["exact_warmup_steps"] = None  # as an earlier version saved it
    sd["hf_zeroone"]["schedule"].update(lr_rising=False, last_lrs=[1e-2])
    with pytest.raises(ValueError, match="earlier version.*exact_warmup_steps set to the number of LR warm-up steps"):
        _zeroone([torch.nn.Parameter(torch.ones(8))], var_freeze_step=30).load_state_dict(sd)
    told = _zeroone([torch.nn.Parameter(torch.ones(8))], var_freeze_step=30, exact_warmup_steps=3)
    told.load_state_dict(sd)
    assert told.schedule["step"] == 5 and "lr_rising" not in told.schedule and "last_lrs" not in told.schedule


def test_re_entering_the_local_phase_starts_from_the_current_parameters():
    """If var_freeze_step moves past the current step, phase 1 returns; its steps must survive the next sync."""
    p = torch.nn.Parameter(torch.ones(8))
    opt = _zeroone([p])
    for _ in range(7):
        p.grad = torch.ones(8)  # a constant gradient: every step moves p down by lr
        opt.step()
    assert opt.schedule["local_phase_started"]
    opt.var_freeze_step = 12  # back to phase 1 for steps 7..11
    start_of_phase1 = p.detach().clone()
    for _ in range(5):
        p.grad = torch.ones(8)
        opt.step()
    assert opt.last_step_kind is not StepKind.LOCAL
    start_of_phase2 = p.detach().clone()
    assert (start_of_phase1 - start_of_phase2).min() > 0.04
    opt.prepare_step()  # entering phase 2 again: the sync point is where p is now
    assert torch.equal(opt.state[p]["sync_param"], start_of_phase2)
    kinds = []
    for _ in range(3):
        kinds.append(opt.next_step_kind())
        p.grad = torch.ones(8)
        opt.step()
    assert StepKind.ONEBIT_SYNC in kinds
    # a stale sync point (step 6) would have thrown the five phase-1 steps away
    assert (start_of_phase1 - p.detach()).min() > 0.04


def test_a_non_finite_sync_is_discarded_and_leaves_finite_parameters():
    p = torch.nn.Parameter(torch.ones(8))
    opt = _zeroone([p], local_step_scaler=100)  # sync gap 1: every local-phase step syncs
    _run(p, opt, 6)
    synced = p.detach().clone()
    assert opt.next_step_kind() is StepKind.ONEBIT_SYNC
    with torch.no_grad():
        p[3] = float("inf")  # an overflowing local update (u is derived from p and the synced parameters)
    p.grad = torch.ones(8)
    with pytest.warns(RuntimeWarning, match="discarded on all ranks"):
        opt.step()
    assert torch.equal(p.detach(), synced)
    assert torch.equal(opt.state[p]["sync_param"], synced)
    assert torch.isfinite(opt.state[p]["exp_avg"]).all()
    _run(p, opt, 4, seed=3)  # and training goes on
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), synced)


def test_error_buffers_of_a_bf16_model_stay_float32_on_load():
    p = torch.nn.Parameter(torch.ones(6, dtype=torch.bfloat16))
    opt = OneBitAdam([p], freeze_step=1)
    p.grad = torch.ones(6, dtype=torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    error = torch.tensor([1e-3, 1.0 + 1e-6, -2.0, 0.0, 3.3e-5, 7.0])  # not representable in bf16
    sd["state"][0]["worker_error"] = error.clone()
    sd["state"][0]["server_error"] = error[:3].clone()
    opt.load_state_dict(sd)
    assert opt.state[p]["worker_error"].dtype == torch.float32
    assert torch.equal(opt.state[p]["worker_error"], error)
    assert torch.equal(opt.state[p]["server_error"], error[:3])
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16


def test_zero_grad_forgets_results_of_a_step_that_was_never_taken():
    p = torch.nn.Parameter(torch.ones(3))
    opt = OneBitAdam([p], freeze_step=2)
    opt.prepare_step()
    opt.communicated_step = opt.schedule["step"]  # what the DDP hook does during backward
    opt.zero_grad()
    assert opt.communicated_step is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.grad = torch.ones(3)
        opt.step()


def _kinds(opt, p, lr_lambda, steps):
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    kinds = []
    for _ in range(steps):
        kinds.append(opt.next_step_kind())
        p.grad = torch.ones_like(p)
        opt.step()
        scheduler.step()
    return kinds


def test_zeroone_adam_communicates_exactly_through_phase_1_by_default():
    def warmup_then_decay(step):
        return (step + 1) / 12 if step < 12 else max(0.0, (40 - step) / 28)

    p = torch.nn.Parameter(torch.ones(4))
    kinds = _kinds(ZeroOneAdam([p], lr=1e-2, var_freeze_step=30, var_update_scaler=1), p, warmup_then_decay, 32)
    assert kinds[:30] == [StepKind.EXACT] * 30  # every step before the freeze, whatever the learning rate does
    assert set(kinds[30:]) <= {StepKind.LOCAL, StepKind.ONEBIT_SYNC}
    # an exact_warmup_steps of its own: the paper's T_v from its end
    q = torch.nn.Parameter(torch.ones(4))
    short = _kinds(
        ZeroOneAdam([q], lr=1e-2, var_freeze_step=30, var_update_scaler=1, exact_warmup_steps=12),
        q,
        warmup_then_decay,
        16,
    )
    assert short[:14] == [StepKind.EXACT] * 13 + [StepKind.ONEBIT_GRADIENT]
    # exact_warmup_steps=0 is the paper's schedule: 1-bit gradients from the second variance gap
    r = torch.nn.Parameter(torch.ones(4))
    paper = ZeroOneAdam([r], lr=1e-2, var_freeze_step=30, var_update_scaler=1, exact_warmup_steps=0)
    assert _kinds(paper, r, warmup_then_decay, 3) == [StepKind.EXACT, StepKind.ONEBIT_GRADIENT, StepKind.EXACT]


def test_zeroone_adam_takes_local_steps_in_runs_shorter_than_deepspeeds_scaler():
    p = torch.nn.Parameter(torch.ones(4))
    opt = ZeroOneAdam([p], lr=1e-2, var_freeze_step=40)
    assert opt.local_step_scaler == 10
    kinds = _kinds(opt, p, lambda s: 1.0, 200)
    assert kinds[150:].count(StepKind.LOCAL) > 40  # the sync gap reached 16 well before the end


def test_a_sync_in_one_process_leaves_the_parameters_where_the_local_steps_did(monkeypatch):
    """u is the displacement since the last sync, decoupled weight decay included (derived, not accumulated).

    With nothing to compress, p = decay_prod * sync_param - u must give back the parameters of the
    last local step; accumulating the Adam updates alone missed the decay of the later steps.
    """
    from hf_zeroone.optim import _local_phase

    moves = []
    apply_sync = _local_phase.apply_sync

    def probe(params, *args, **kwargs):
        before = [p.detach().clone() for p in params]
        apply_sync(params, *args, **kwargs)
        moves.append(max((p.detach() - b).abs().max().item() for p, b in zip(params, before)))

    monkeypatch.setattr(_local_phase, "apply_sync", probe)
    p = torch.nn.Parameter(torch.linspace(-1, 1, 64))
    opt = ZeroOneAdam([p], lr=1e-2, weight_decay=0.1, var_freeze_step=4, local_step_scaler=1, local_step_clipper=8)
    _run(p, opt, 40)
    assert len(moves) >= 5 and opt.schedule["local_step_interval"] == 8  # syncs with gaps up to 8
    assert max(moves) <= 1.2e-7, moves  # rounding only (one ulp at |p| = 1)
    assert "update_accumulator" not in opt.state[p]  # fp32: nothing accumulated


def test_a_bf16_parameter_keeps_accumulating_u():
    p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = _zeroone([p])
    for _ in range(7):
        p.grad = torch.linspace(-1, 1, 8, dtype=torch.bfloat16)
        opt.step()
    assert opt.last_step_kind is StepKind.LOCAL
    assert opt.state[p]["update_accumulator"].dtype == torch.bfloat16  # its rounding would lose small steps


def test_a_server_error_that_does_not_fit_the_parameter_is_refused():
    p = torch.nn.Parameter(torch.ones(6))
    opt = OneBitAdam([p], freeze_step=1)
    p.grad = torch.ones(6)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["server_error"] = torch.zeros(4)
    sd["state"][0]["server_error_start"] = 3
    with pytest.raises(ValueError, match="server_error for a parameter of shape \\(6,\\) covers elements 3 to 7"):
        OneBitAdam([p], freeze_step=1).load_state_dict(sd)


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
@pytest.mark.parametrize("saved_shape", [(3, 4), (1, 20), (20,)])
def test_a_checkpoint_of_another_models_shapes_is_refused_and_nothing_is_loaded(cls, saved_shape):
    """It loaded (torch checks only the number of parameters), replaced the state, and failed at the next step."""
    kw = {"freeze_step": 2} if cls is OneBitAdam else {"var_freeze_step": 2}
    saved = torch.nn.Parameter(torch.zeros(saved_shape))
    opt_saved = cls([saved], lr=1e-2, **kw)
    for _ in range(3):
        saved.grad = torch.ones(saved_shape)
        opt_saved.step()
    p = torch.nn.Parameter(torch.zeros(5, 4))
    opt = cls([p], lr=1e-2, **kw)
    p.grad = torch.ones(5, 4)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 has shape .*but that parameter has shape \(5, 4\)"):
        opt.load_state_dict(opt_saved.state_dict())
    assert opt.schedule["step"] == 1
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())
    p.grad = torch.ones(5, 4)
    opt.step()  # trains on as before
    assert opt.schedule["step"] == 2


@pytest.mark.parametrize("two_groups", [False, True])
def test_after_a_load_the_groups_handed_to_the_messages_are_the_loaded_ones(two_groups):
    """torch's ``load_state_dict`` puts new dicts in ``param_groups`` (the ones an LR scheduler then writes to).

    The optimizer's table from parameter to group kept the dicts from before the load: a resumed
    run's messages read hyper-parameters that nothing updated any more.
    """
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))
    groups = [{"params": [a]}, {"params": [b], "eps": 1e-6}] if two_groups else [{"params": [a, b]}]
    opt = OneBitAdam(groups, freeze_step=2)
    opt.grouped([a, b], [None, None])  # the table is built before the load
    saved = opt.state_dict()
    saved["param_groups"][0]["eps"] = 1e-4
    opt.load_state_dict(saved)
    handed = opt.grouped([a, b], [None, None])
    assert all(any(g is h for h in opt.param_groups) for g, _, _ in handed)
    assert handed[0][0]["eps"] == 1e-4


def test_a_tensor_first_reached_after_the_freeze_takes_no_other_tensors_samples():
    """A tensor with no gradient before the freeze has no gradient scale yet; one after it in the group has.

    The local step's samples were taken from the tensors that have one, paired with the gradients
    of the whole group: the first tensor's gradient went with the second's variance (a shape error
    here; with equal shapes, another tensor's sample). Each now takes its own, as without the other.
    """
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))
    alone = torch.nn.Parameter(b.detach().clone())
    opt, opt_alone = _zeroone([a, b], var_freeze_step=3), _zeroone([alone], var_freeze_step=3)
    gen = torch.Generator().manual_seed(1)
    for step in range(9):
        grad_a, grad_b = torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)
        a.grad = grad_a if step >= 3 else None  # first reached in the local phase
        b.grad, alone.grad = grad_b.clone(), grad_b.clone()
        opt.step()
        opt_alone.step()
    assert opt.last_step_kind in (StepKind.LOCAL, StepKind.ONEBIT_SYNC)
    assert "grad_scale" not in opt.state[a]
    assert torch.equal(opt.state[b]["grad_scale"], opt_alone.state[alone]["grad_scale"])
    assert torch.equal(b, alone)


@pytest.mark.parametrize("cls, kwargs", [(OneBitAdam, dict(freeze_step=3)), (ZeroOneAdam, {})])
def test_moments_are_one_flat_tensor_each_from_the_first_step_and_after_a_load_with_the_same_steps(cls, kwargs):
    """State made or loaded is laid out flat (one operation can cover it all); a resumed run keeps the bits."""
    from hf_zeroone._tensors import flat_span

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
        params = list(model.parameters())
        opt = (_zeroone if cls is ZeroOneAdam else cls)(params, lr=1e-2, **kwargs)
        return params, opt

    def train(params, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()

    def flat(params, opt):
        return all(flat_span([opt.state[p][k] for p in params]) is not None for k in ("exp_avg", "exp_avg_sq"))

    params, opt = build()
    train(params, opt, 5, 0)
    assert flat(params, opt)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed_params, resumed = build()
    with torch.no_grad():
        for p, q in zip(resumed_params, params):
            p.copy_(q)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert flat(resumed_params, resumed)
    train(params, opt, 7, 1)
    train(resumed_params, resumed, 7, 1)
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)
