"""Gradients AdamW trains with must not stop or poison training: a tensor the loss does not reach
(zero gradient), one it barely reaches (a gradient whose square underflows float32), and
gradients of 1e12 (Adam is scale-invariant).

Before the fixes, on 2 ranks with the defaults: 1-bit Adam's first 1-bit step divided a zero
tensor's zero handed-on norm by itself (0/0), its ``follow_gradient_scale`` factor became NaN and
then its parameters; 0/1 Adam's noise excess ``rho`` was 0 and its samples 0/0; with a gradient
of 1e-22 every 1-bit step was skipped as non-finite, forever (the skip keeps the state that
produced the NaN). Gradients of 1e12, measured against the first step's ``v = 0``, overflowed
both samples of ``rho`` (inf / inf): ``rho`` stayed NaN, 1-bit Adam skipped every step after the
freeze and 0/1 Adam raised on its first local step.
"""

import warnings

import pytest
import torch

from _dist import run_ranks

STEPS = 60


def _optimizer(name, params, lr):
    """AdamW, or ours with the defaults and an early freeze (step 6), so that most steps are compressed."""
    from hf_zeroone import OneBitAdam, ZeroOneAdam

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "onebit":
        return OneBitAdam(params, lr=lr, freeze_step=6)
    return ZeroOneAdam(params, lr=lr, var_freeze_step=6, exact_warmup_steps=2)


def _train(rank, world_size, name, path, with_idle, scale=1.0):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone.ddp_hook import register_zeroone_hook

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(16, 4)
            if with_idle:
                self.dead = torch.nn.Parameter(torch.randn(8, 8))  # reached with a factor 0: gradient 0
                self.faint = torch.nn.Parameter(torch.randn(40))  # gradient 1e-22: its square is 0 in float32

        def forward(self, x):
            out = self.lin(x) * scale
            if with_idle:
                out = out + 0.0 * self.dead.sum() + 1e-22 * self.faint.sum()
            return out

    model = Model()
    trained = DDP(model) if path == "hook" else model
    opt = _optimizer(name, list(model.parameters()), 5e-2)
    if path == "hook":
        register_zeroone_hook(trained, opt)
    gen = torch.Generator().manual_seed(1 + rank)
    target = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            x = torch.randn(32, 16, generator=gen)
            loss = (trained(x) - scale * (x @ target)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    non_finite = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"losses": losses, "non_finite": non_finite, "steps": opt.schedule["step"], "finite": finite}


@pytest.mark.filterwarnings("ignore:.*communicates in step\\(\\) because no hf_zeroone DDP hook")
@pytest.mark.parametrize("path", ["step", "hook"])
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_tensors_without_gradient_neither_poison_nor_stall_training(name, path):
    idle = run_ranks(_train, 2, name, path, True)
    plain = run_ranks(_train, 2, name, path, False)
    for rank in idle:
        assert rank["finite"], f"{name} ({path}): a parameter became non-finite"
        assert not rank["non_finite"], rank["non_finite"][:2]
        assert rank["steps"] == STEPS, f"{name} ({path}): {STEPS - rank['steps']} steps skipped"
    # the live layer trains as it does without the idle tensors beside it
    late = lambda r: sum(r["losses"][-10:]) / 10  # noqa: E731
    assert late(idle[0]) < 0.5 * idle[0]["losses"][0], idle[0]["losses"]
    assert late(idle[0]) == pytest.approx(late(plain[0]), rel=0.25), (late(idle[0]), late(plain[0]))


@pytest.mark.filterwarnings("ignore:.*communicates in step\\(\\) because no hf_zeroone DDP hook")
@pytest.mark.parametrize("scale", [1e6, 3e9])
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_large_gradients_train_as_ones_of_1(name, scale):
    """Adam's steps do not depend on the gradients' scale: neither may the defaults'.

    Gradients of about 1e12 (``scale`` 1e6): ``rho`` was NaN and the run stalled. Of up to 1.7e19
    (3e9; AdamW's ``v = g^2`` just fits float32 there): the weight's float32 norm overflows, and
    1-bit Adam skipped every step from its first 1-bit step on (the squared norms averaged for
    clipping were inf, then an implied gradient's norm and the norm handed on: inf / inf).
    """
    large = run_ranks(_train, 2, name, "step", False, scale)
    plain = run_ranks(_train, 2, name, "step", False)
    for rank in large:
        assert rank["finite"] and not rank["non_finite"], rank["non_finite"][:2]
        assert rank["steps"] == STEPS, f"{name}: {STEPS - rank['steps']} steps skipped"
    late_large = sum(large[0]["losses"][-10:]) / 10 / scale**2  # the loss scales as the square
    late_plain = sum(plain[0]["losses"][-10:]) / 10
    assert late_large == pytest.approx(late_plain, rel=0.25), (late_large, late_plain)


def test_the_fraction_clipping_left_of_a_zero_norm_is_one():
    from hf_zeroone.optim._grad_scale import norm_left

    after = torch.tensor([0.0, 0.5, 3.0])
    handed = torch.tensor([0.0, 1.0, 3.0])
    assert norm_left(after, handed).tolist() == [1.0, 0.5, 1.0]
    inf = float("inf")  # a float32 norm that overflowed, handed on and left as it was
    assert norm_left(torch.tensor([inf, 0.0]), torch.tensor([inf, inf])).tolist() == [1.0, 0.0]


def test_an_overflowed_mean_square_norm_leaves_the_implied_gradient_as_it_is():
    from hf_zeroone.optim._functional import norm_proxy_factors

    views = [torch.full((4,), 2.0), torch.full((4,), 2.0)]
    (factor, factor_inf), (handed, handed_inf) = norm_proxy_factors(views, torch.tensor([64.0, float("inf")]))
    assert (float(factor), float(handed)) == (2.0, 8.0)
    assert (float(factor_inf), float(handed_inf)) == (1.0, 4.0)
    assert views[1].tolist() == [2.0] * 4


def test_an_implied_gradient_too_small_to_rescale_is_left_as_it_is():
    """A subnormal norm made the factor ``root / norm`` overflow: the view became inf, and the step was skipped.

    Seen on a one-element bias whose 1-bit momentum decayed to 1e-45 (a loopback run); any
    momentum that small would have skipped every step from there on.
    """
    from hf_zeroone.optim._functional import norm_proxy_factors

    tiny = torch.tensor([-1.2612e-44])  # subnormal in float32
    views = [tiny.clone(), torch.full((4,), 2.0)]
    (factor, factor2), (handed, handed2) = norm_proxy_factors(views, torch.tensor([0.2138, 64.0]))
    assert (float(factor), float(handed)) == (1.0, float(tiny.abs()))
    assert torch.equal(views[0], tiny)
    assert (float(factor2), float(handed2)) == (2.0, 8.0)


def _late_layer(rank, world_size, name, start, how="used"):
    torch.manual_seed(0)
    first, late = torch.nn.Linear(16, 4), torch.nn.Linear(4, 4)
    torch.nn.init.eye_(late.weight)
    torch.nn.init.zeros_(late.bias)
    # "used" from `start` on; "unfrozen": in the model all along, trainable from `start` on;
    # "added": in the model all along, given to the optimizer (add_param_group) at `start`
    late.requires_grad_(how != "unfrozen")
    params = [*first.parameters(), *late.parameters()] if how != "added" else [*first.parameters()]
    opt = _optimizer(name, params, 2e-2)
    gen = torch.Generator().manual_seed(1 + rank)
    target = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    losses = []
    for i in range(80):
        x = torch.randn(32, 16, generator=gen)
        out = first(x)
        if how == "unfrozen":
            late.requires_grad_(i >= start)
        if how == "added" and i == start:
            opt.add_param_group({"params": list(late.parameters())})
        if how != "used":
            out = late(out)
        elif i >= start:  # switched on after the freeze: no gradient, so v = 0, until then
            out = late(out)
        loss = (out - x @ target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"late": sum(losses[-10:]) / 10, "moved": float((late.weight - torch.eye(4)).abs().max())}


@pytest.mark.filterwarnings("ignore:.*communicates in step\\(\\) because no hf_zeroone DDP hook")
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_layer_switched_on_after_the_freeze_trains(name):
    """A tensor with no gradient before the freeze (``v = 0``: a layer switched on later, an unfrozen backbone).

    Before the fix its first sample was measured against ``d = eps``: ``(g / eps)^2`` raised its
    ``follow_gradient_scale`` factor to about 1e15, and the layer never moved (the run's loss was
    that of a run without it: 1-bit Adam 2.62, 0/1 Adam 2.26, against AdamW's 0.116).
    """
    ours = run_ranks(_late_layer, 2, name, 20)[0]
    never = run_ranks(_late_layer, 2, name, 10**6)[0]  # the layer stays the identity
    assert ours["moved"] > 0.3, ours  # was 0.0: not one step
    assert ours["late"] < 0.9 * never["late"], (ours, never)  # was equal: 0.16 (1-bit), 0.78 (0/1) of it now
    if name == "onebit":  # 0/1 Adam's local steps (gaps up to 16 in 80 steps) end this toy higher either way
        adamw = run_ranks(_late_layer, 2, "adamw", 20)[0]
        assert ours["late"] < 3 * adamw["late"], (ours, adamw)  # 0.164 against 0.116


@pytest.mark.filterwarnings("ignore:.*communicates in step\\(\\) because no hf_zeroone DDP hook")
@pytest.mark.parametrize("how", ["unfrozen", "added"])
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_layer_unfrozen_after_the_freeze_trains(name, how):
    """``requires_grad`` turned on at step 20 (a backbone unfrozen after the first epoch), or ``add_param_group``.

    Before the fix 0/1 Adam raised ``KeyError: 'lr_sum'`` on its next local step (the layer had no
    local-phase state); with that state and no mask, its ``v`` stayed 0 and the run diverged (loss
    20 against 16.8 at the start). Such a parameter now joins as :func:`build_masks` would have
    taken it at the freeze: masked, then released with the fallback variance by its first gradient.
    """
    ours = run_ranks(_late_layer, 2, name, 20, how)[0]
    never = run_ranks(_late_layer, 2, name, 10**6, how)[0]  # frozen, or left out, all along
    assert ours["moved"] > 0.3, ours
    assert ours["late"] < 0.9 * never["late"], (ours, never)


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.always, self.sometimes = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x, taken):
        return self.always(x) + (self.sometimes(x) if taken else 0)


def _branch_on_one_rank(rank, world_size, path):
    """0/1 Adam; rank 0's batches take a layer on odd steps only, rank 1's on every step (experts)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import ZeroOneAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import train_linear_target

    model = _Experts()
    opt = ZeroOneAdam(model.parameters(), lr=2e-2, var_freeze_step=10, exact_warmup_steps=2, local_step_scaler=2)
    trained = DDP(model, find_unused_parameters=True) if path == "hook" else model
    if path == "hook":
        register_zeroone_hook(trained, opt)
    losses = train_linear_target(lambda x, i: trained(x, rank == 1 or i % 2 == 1), opt, rank, 40)
    opt.synchronize()
    return {"params": torch.cat([p.detach().flatten() for p in model.parameters()]), "late": sum(losses[-10:]) / 10}


def test_a_layer_one_rank_skips_leaves_the_replicas_identical_after_local_steps():
    """``step()`` without DDP: rank 0 has no gradient for a layer on some local steps.

    Before the fix rank 0 skipped that layer's local step and booked neither its learning rate nor
    its decay, so the next sync, which rescales by them, put different parameters on the two
    ranks, silently (the run ended with unequal replicas). A missing gradient is now a zero one on
    local steps too, as the other step kinds and DDP (``find_unused_parameters``) treat it.
    """
    step = run_ranks(_branch_on_one_rank, 2, "step")
    hook = run_ranks(_branch_on_one_rank, 2, "hook")
    assert torch.equal(step[0]["params"], step[1]["params"])
    assert torch.equal(hook[0]["params"], hook[1]["params"])
    assert step[0]["late"] == pytest.approx(hook[0]["late"], rel=0.05), (step[0]["late"], hook[0]["late"])
