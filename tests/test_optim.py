"""Single-process behaviour of OneBitAdam and ZeroOneAdam: Adam equivalence, schedules, state."""

import io
import warnings

import pytest
import torch

from hf_zeroone import OneBitAdam, StepKind, ZeroOneAdam


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 1))


def _batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 10, generator=g)
        out.append((x, x.sum(1, keepdim=True)))
    return out


def _train(model, opt, batches, scheduler=None):
    losses = []
    for x, y in batches:
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("decoupled", [True, False])
def test_warmup_is_exactly_torch_adam(decoupled):
    batches = _batches(25)
    ref_model = _model()
    ref_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    _train(ref_model, ref_cls(ref_model.parameters(), lr=1e-2, weight_decay=0.05), batches)
    for make in (
        lambda p: OneBitAdam(p, lr=1e-2, weight_decay=0.05, freeze_step=100, decoupled_weight_decay=decoupled),
        lambda p: ZeroOneAdam(p, lr=1e-2, weight_decay=0.05, var_update_scaler=100, decoupled_weight_decay=decoupled),
    ):
        model = _model()
        opt = make(model.parameters())
        _train(model, opt, batches)
        assert torch.allclose(_flat(model), _flat(ref_model), rtol=1e-6, atol=1e-7)
        assert opt.last_step_kind is StepKind.EXACT


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_swapping_the_class_name_of_adamw_changes_nothing_else(cls):
    """``AdamW(params, lr=...)`` -> ``OneBitAdam(params, lr=...)``: the same defaults, the same exact steps.

    The weight decay defaulted to DeepSpeed's 0 where AdamW's is 1e-2: a loop written for AdamW
    (Accelerate's examples pass only ``lr``) trained without weight decay after the swap.
    """
    batches = _batches(25)
    ref_model, model = _model(), _model()
    options = dict(lr=1e-2, foreach=True)  # AdamW's implementation choices (foreach, fused) carry over too
    ref = torch.optim.AdamW(ref_model.parameters(), **options)
    ours = cls(model.parameters(), **options)  # one process, no run length: every step exact
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert ours.defaults[key] == ref.defaults[key], key
    _train(ref_model, ref, batches)
    _train(model, ours, batches)
    assert ours.last_step_kind is StepKind.EXACT
    assert torch.allclose(_flat(model), _flat(ref_model), rtol=1e-6, atol=1e-7)


def test_no_bias_correction_matches_the_deepspeed_formula():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = OneBitAdam([p], lr=0.1, bias_correction=False, eps=1e-8, weight_decay=0.0)  # DeepSpeed's default
    p.grad = torch.tensor([0.5, 0.25])
    opt.step()
    m = 0.1 * p.grad
    v = 0.001 * p.grad**2
    expected = torch.tensor([1.0, -2.0]) - 0.1 * m / (v.sqrt() + 1e-8)
    assert torch.allclose(p.detach(), expected)


def test_zeroone_schedule_kinds():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = ZeroOneAdam(
        [p],
        var_freeze_step=12,
        var_update_scaler=2,
        local_step_scaler=3,
        local_step_clipper=4,
        exact_warmup_steps=2,
    )
    kinds = []
    for _ in range(26):
        kinds.append(opt.next_step_kind())
        p.grad = torch.ones(3)
        opt.step()
    E, G = StepKind.EXACT, StepKind.ONEBIT_GRADIENT
    S, L = StepKind.ONEBIT_SYNC, StepKind.LOCAL
    # 2 exact warm-up steps; then T_v gaps 1,1 | 2,2 | 4...; from step 12 local steps whose sync gap
    # doubles every 3 steps (1,1,1 | 2 | 4), counting from the last sync.
    assert kinds[:12] == [E, E, E, E, G, E, G, E, G, G, G, E]
    assert kinds[12:15] == [S, S, S]
    assert kinds[15:18] == [L, S, L]
    assert kinds[18:26] == [L, L, S, L, L, L, S, L]


def test_onebit_schedule_kinds():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = OneBitAdam([p], freeze_step=3)
    kinds = []
    for _ in range(5):
        kinds.append(opt.next_step_kind())
        p.grad = torch.ones(3)
        opt.step()
    assert kinds == [StepKind.EXACT] * 3 + [StepKind.ONEBIT_MOMENTUM] * 2


def test_zeroone_local_steps_honour_a_changing_learning_rate():
    """Syncing every step or every few steps must land on the same parameters at sync points.

    In one process (nothing to compress) with beta1 = 0 (no momentum to re-estimate) a sync
    reproduces the local trajectory exactly, but only if the accumulated update u follows the
    scheduler's learning rate at every local step. ``follow_gradient_scale`` is off: its factor moves at
    the syncs (so that every replica keeps the same one), so it differs between the two gaps by design.
    """
    batches = _batches(40)
    results = []
    for clipper, scaler in ((1, 10**6), (4, 1)):
        model = _model()
        opt = ZeroOneAdam(
            model.parameters(),
            lr=1e-2,
            betas=(0.0, 0.999),
            weight_decay=0.0,
            var_freeze_step=8,
            local_step_scaler=scaler,
            local_step_clipper=clipper,
            follow_gradient_scale=False,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        snapshots = {}
        for i, (x, y) in enumerate(batches):
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if opt.last_step_kind is StepKind.ONEBIT_SYNC:
                snapshots[i] = _flat(model)
        results.append(snapshots)
    # The coarse run syncs at steps 8, 12, 16, 20, ... (the gap doubles every step up to 4).
    common = sorted(set(results[0]) & set(results[1]))
    assert common[:4] == [8, 12, 16, 20]
    for i in common:
        assert torch.allclose(results[0][i], results[1][i], rtol=1e-5, atol=1e-6), i


def test_lr_zero_freezes_parameters_in_every_phase():
    model = _model()
    before = _flat(model)
    opt = ZeroOneAdam(
        model.parameters(), lr=0.0, var_freeze_step=5, var_update_scaler=1, weight_decay=0.1, exact_warmup_steps=0
    )  # the paper's phase 1, so that every step kind comes
    _train(model, opt, _batches(12))
    assert torch.equal(_flat(model), before)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: OneBitAdam(p, lr=1e-2, freeze_step=4, weight_decay=0.01),
        lambda p: ZeroOneAdam(
            p,
            lr=1e-2,
            var_freeze_step=10,
            var_update_scaler=2,
            local_step_scaler=2,
            local_step_clipper=4,
            weight_decay=0.01,
            exact_warmup_steps=0,  # every step kind
        ),
    ],
    ids=["onebit", "zeroone"],
)
def test_state_dict_round_trip_continues_exactly(make):
    batches = _batches(30)
    model = _model()
    opt = make(model.parameters())
    _train(model, opt, batches)
    straight = _flat(model)

    model = _model()
    opt = make(model.parameters())
    _train(model, opt, batches[:13])
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    model2 = _model()
    model2.load_state_dict(saved["model"])
    opt2 = make(model2.parameters())
    opt2.load_state_dict(saved["opt"])
    assert opt2.schedule == opt.schedule
    _train(model2, opt2, batches[13:])
    assert torch.equal(_flat(model2), straight)


def test_loading_a_checkpoint_of_another_kind_or_rank():
    model = _model()
    onebit = OneBitAdam(model.parameters(), freeze_step=1)
    _train(model, onebit, _batches(3))
    with pytest.raises(ValueError, match="saved by OneBitAdam, cannot load it into ZeroOneAdam"):
        ZeroOneAdam(model.parameters()).load_state_dict(onebit.state_dict())
    with pytest.raises(ValueError, match="not saved by a hf_zeroone optimizer"):
        OneBitAdam(model.parameters()).load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    sd = onebit.state_dict()
    sd["hf_zeroone"]["world_size"] = 4
    sd["hf_zeroone"]["rank"] = 3
    fresh = OneBitAdam(model.parameters(), freeze_step=1)
    with pytest.warns(UserWarning, match="error-feedback buffers reset"):
        fresh.load_state_dict(sd)
    assert fresh.schedule["step"] == 3
    assert all("worker_error" not in s for s in fresh.state.values())


def test_edge_shapes_and_frozen_and_late_parameters():
    scalar = torch.nn.Parameter(torch.tensor(1.0))
    empty = torch.nn.Parameter(torch.zeros(0, 3))
    odd = torch.nn.Parameter(torch.ones(7, 3))
    frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    opt = ZeroOneAdam(
        [scalar, empty, odd, frozen], lr=0.1, var_freeze_step=3, var_update_scaler=1, exact_warmup_steps=0
    )
    late = torch.nn.Parameter(torch.ones(5))
    for step in range(8):
        if step == 2:
            opt.add_param_group({"params": [late], "lr": 0.01})
        loss = scalar**2 + empty.sum() + (odd**2).sum() + (late**2).sum()
        opt.zero_grad()
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
    for p in (scalar, empty, odd, late):
        assert torch.isfinite(p).all()
    assert scalar.item() < 1.0 and late[0].item() < 1.0
    assert torch.equal(frozen, torch.ones(4))


def test_auto_momentum_mask_finds_elements_that_never_had_a_gradient():
    emb = torch.nn.Embedding(10, 4)
    opt = OneBitAdam(emb.parameters(), freeze_step=3)
    for _ in range(5):
        loss = emb(torch.tensor([1, 2, 3])).sum()  # rows 0 and 4..9 never used
        opt.zero_grad()
        loss.backward()
        opt.step()
    mask = opt.state[emb.weight]["momentum_mask"]
    assert mask[1:4].all() and not mask[0].any() and not mask[4:].any()


def test_user_momentum_mask_is_combined():
    w = torch.nn.Parameter(torch.ones(4, 2))
    user = torch.tensor([[1.0], [1.0], [0.0], [1.0]])
    opt = OneBitAdam([{"params": [w], "exp_avg_mask": user}], freeze_step=1)
    for _ in range(3):
        w.grad = torch.ones(4, 2)
        opt.step()
    assert opt.state[w]["momentum_mask"].tolist() == [
        [True, True],
        [True, True],
        [False, False],
        [True, True],
    ]


def test_masked_elements_do_not_move_on_local_steps_until_they_get_a_gradient():
    """An element with no gradient before the mask was built stays out of local steps (its v is 0)."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = ZeroOneAdam([p], lr=0.01, var_freeze_step=3, var_update_scaler=1, local_step_scaler=1, weight_decay=0.0)
    kinds, masks = [], []
    for step in range(24):
        kinds.append(opt.next_step_kind())
        # element 3 has no gradient during the variance phase, then a large one
        p.grad = torch.tensor([1.0, -1.0, 0.5, 0.0 if step < 5 else 5.0])
        opt.step()
        mask = opt.state[p].get("momentum_mask")
        masks.append(None if mask is None else mask.clone())
        assert torch.isfinite(p).all()
        if step < 5:
            assert p[3].item() == 1.0  # without the mask: 1 - lr * m / eps, about -5e5
            assert opt.state[p]["exp_avg"][3].item() == 0.0
    assert StepKind.LOCAL in kinds and StepKind.ONEBIT_SYNC in kinds
    assert masks[4].tolist() == [True, True, True, False]
    assert masks[-1] is None  # released at the first sync after it had a gradient
    assert 0.8 < p[3].item() < 1.0 and (p[:3] != 1.0).all()  # then Adam-sized steps


def test_non_finite_gradient_on_a_local_step_is_an_error():
    p = torch.nn.Parameter(torch.ones(3))
    opt = ZeroOneAdam([p], var_freeze_step=1, local_step_clipper=4, local_step_scaler=1)
    for _ in range(2):
        p.grad = torch.ones(3)
        opt.step()
    assert opt.next_step_kind() is StepKind.LOCAL
    p.grad = torch.tensor([1.0, float("nan"), 1.0])
    with pytest.raises(RuntimeError, match="non-finite local gradient"):
        opt.step()


def test_non_finite_gradient_on_a_communicating_step_is_skipped():
    p = torch.nn.Parameter(torch.ones(3))
    opt = OneBitAdam([p], freeze_step=5)
    p.grad = torch.tensor([1.0, float("inf"), 1.0])
    with pytest.warns(RuntimeWarning, match="step skipped"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and opt.schedule["step"] == 0


def test_recommended_local_steps_keep_short_runs_syncing_often():
    from hf_zeroone import recommended_local_steps

    # long runs: the paper's largest gap, reached a quarter of the way into the local phase
    assert recommended_local_steps(2000, 400) == {"local_step_scaler": 100, "local_step_clipper": 16}
    assert recommended_local_steps(100_000, 20_000) == {"local_step_scaler": 5000, "local_step_clipper": 16}
    # the suite's 90-step fine-tuning run (72 local-phase steps): a sync at every step, not a gap of 16
    assert recommended_local_steps(90, 18) == {"local_step_scaler": 18, "local_step_clipper": 1}
    # at most a sixty-fourth of the phase, rounded down to a power of two (1000 - 300 = 700: 10 -> 8)
    assert recommended_local_steps(1000, 300) == {"local_step_scaler": 58, "local_step_clipper": 8}
    assert recommended_local_steps(300, 60) == {"local_step_scaler": 60, "local_step_clipper": 2}
    assert recommended_local_steps(10, 10) == {"local_step_scaler": 1, "local_step_clipper": 1}  # no local phase
    assert recommended_local_steps(90, 18, local_step_clipper=16)["local_step_clipper"] == 16  # explicit: kept
    for bad, match in [((0, 0), "num_training_steps"), ((10, -1), "var_freeze_step"), ((10, 2, 0), "clipper")]:
        with pytest.raises(ValueError, match=match):
            recommended_local_steps(*bad)


def test_recommended_freeze_step_is_the_later_of_the_warmup_and_30_percent_of_the_run():
    from hf_zeroone import recommended_freeze_step

    assert recommended_freeze_step(500, 50) == 150  # 30% of the run after a 10% warm-up
    assert recommended_freeze_step(1000, 2 * 100) == 300  # 0/1 Adam: twice the warm-up
    assert recommended_freeze_step(1000, 400) == 400  # a long warm-up wins
    assert recommended_freeze_step(35) == 11  # 30% of 35 is 10.5, rounded up
    assert recommended_freeze_step(1) == 1  # never 0: the variance must be estimated once
    for bad, match in [((0,), "num_training_steps"), ((10.0,), "num_training_steps"), ((10, -1), "warmup_steps")]:
        with pytest.raises(ValueError, match=match):
            recommended_freeze_step(*bad)
