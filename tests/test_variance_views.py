"""What a frozen variance gives the steps: computed once per version of ``v``, never read stale, changing nothing."""

import pytest
import torch

from hf_zeroone import OneBitAdam, ZeroOneAdam
from hf_zeroone.optim import _functional as F
from hf_zeroone.optim import _variance_views
from hf_zeroone.optim._grad_scale import sample_statistics
from hf_zeroone.optim._memory import state_bytes
from hf_zeroone.optim._variance_views import VarianceViews


def _fresh(vs, c2, eps):
    return F.denominators(vs, c2, eps)


def test_every_change_of_v_c2_or_eps_recomputes_and_a_frozen_v_is_reused():
    params = [torch.zeros(5, 3), torch.zeros(7)]
    vs = [torch.rand(5, 3) + 0.1, torch.rand(7) + 0.1]
    views = VarianceViews()
    first = views.denominators(params, vs, 0.5, 1e-8)
    assert all(a is b for a, b in zip(first, views.denominators(params, vs, 0.5, 1e-8)))  # reused while frozen

    vs[0].mul_(4.0)  # an in-place variance update
    after = views.denominators(params, vs, 0.5, 1e-8)
    assert after[1] is first[1]
    assert torch.equal(after[0], _fresh(vs, 0.5, 1e-8)[0]) and not torch.equal(after[0], first[0])

    vs[1] = vs[1] * 9.0  # a new tensor in its place (a checkpoint load)
    assert torch.equal(views.denominators(params, vs, 0.5, 1e-8)[1], _fresh(vs, 0.5, 1e-8)[1])
    for c2, eps in ((0.25, 1e-8), (0.25, 1e-3)):
        assert all(torch.equal(a, b) for a, b in zip(views.denominators(params, vs, c2, eps), _fresh(vs, c2, eps)))


def test_a_whole_list_is_reused_at_once_until_released_and_counts_while_held():
    """Denominators offered for a whole list come back for it in one check; a release ends that, none held after."""
    params = [torch.zeros(4), torch.zeros(6), torch.zeros(2)]
    vs = [torch.rand(4) + 0.1, torch.rand(6) + 0.1, torch.rand(2) + 0.1]
    views = VarianceViews()
    offered = _fresh(vs, 0.5, 1e-8)
    views.offer(params, vs, 0.5, 1e-8, offered)
    assert all(a is b for a, b in zip(views.denominators(params, vs, 0.5, 1e-8), offered))
    assert views.denominators(params[:2], vs[:2], 0.5, 1e-8)[1] is offered[1]  # a part: tensor by tensor
    views.denominators(params[:2], vs[:2], 0.25, 1e-8)  # new ones for two tensors: the list's record holds the old
    assert {id(t) for t in offered} <= {id(t) for t in views.held()}
    views.release([params[0]])  # a bucket's end
    again = views.denominators(params, vs, 0.5, 1e-8)
    assert again[0] is not offered[0] and torch.equal(again[0], offered[0]) and again[2] is offered[2]
    assert torch.equal(again[1], offered[1])  # recomputed for c2 = 0.5 after the 0.25 ones replaced it
    swapped = [params[0], params[2], params[1]]  # same first tensor and length, other members
    got = views.denominators(swapped, [vs[0], vs[2], vs[1]], 0.5, 1e-8)
    assert got[1] is again[2] and got[2] is again[1]  # tensor by tensor, not the list of (params[0], 3)
    views.release()
    assert views.held() == []


def test_statistics_follow_v_and_the_host_reads_them_only_when_a_step_settles():
    params = [torch.zeros(64), torch.zeros(32)]
    vs = [torch.rand(64) + 0.1, torch.rand(32) + 0.1]
    vs[0][:10] = 0.0  # idle elements: d = eps, far below a tenth of the mean
    views = VarianceViews()
    for _ in range(2):  # built, then reused within the "step": never read on the host
        dens, stats = views.statistics(params, vs, 1.0, 1e-8)
        means, counts, idle = sample_statistics(_fresh(vs, 1.0, 1e-8))
        assert torch.equal(stats.means, means) and torch.equal(stats.counts, counts)
        assert stats.idle is None  # unknown: every tensor is masked
    assert idle.tolist() == [True, False] and counts.tolist() == [54.0, 32.0]
    views.release()
    views.settle()  # the end of the step: v unchanged, one host read
    assert views.statistics(params, vs, 1.0, 1e-8)[1].idle == [True, False]
    vs[0].fill_(1.0)
    views.settle()  # v changed after the statistics: nothing to read
    _, stats = views.statistics(params, vs, 1.0, 1e-8)
    assert stats.counts.tolist() == [64.0, 32.0] and stats.idle is None  # rebuilt: every tensor masked again
    views.release(params[:1])
    # the second tensor's d; 3 floats per tensor; the list's means and counts, one float per tensor each
    assert [t.numel() for t in views.held()] == [32] + [1] * 6 + [2, 2]
    views.release()
    held = views.held()  # nothing full-size
    assert sum(t.numel() for t in held) == 5 * len(params) and all(t.dim() <= 1 for t in held)
    stats = views.statistics(params, vs, 1.0, 1e-8)[1]
    assert views.statistics(params, vs, 1.0, 1e-8)[1] is stats  # a whole list's statistics: remembered
    assert views.statistics(params, vs, 0.5, 1e-8)[1] is not stats  # another c2
    assert views.statistics(params, vs, 1.0, 1e-8, idle_eps=1e-8)[1] is not stats  # another idle rule
    vs[1].mul_(2.0)  # written in place: its version moved
    again = views.statistics(params, vs, 1.0, 1e-8)[1]
    assert again is not stats and torch.equal(again.means, sample_statistics(_fresh(vs, 1.0, 1e-8))[0])
    replaced = [vs[0], vs[1].clone().mul_(3.0)]  # a new tensor in its place (its own version counter)
    fresh = views.statistics(params, replaced, 1.0, 1e-8)[1]
    assert torch.equal(fresh.means, sample_statistics(_fresh(replaced, 1.0, 1e-8))[0])
    other = [params[0], torch.zeros(32)]  # the same first parameter and length, another second
    assert views.statistics(other, replaced, 1.0, 1e-8)[1] is not fresh


def _train(cls, kwargs, cached: bool, monkeypatch):
    if not cached:  # every value computed afresh on every use, as before the views existed
        monkeypatch.setattr(VarianceViews, "_valid", staticmethod(lambda table, p, key: None))
        monkeypatch.setattr(_variance_views, "_versions", lambda ts: None)  # no list remembered either
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
    gen = torch.Generator().manual_seed(1)
    kinds = set()
    for _ in range(40):
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        (model(x) - x.flip(1)).pow(2).mean().backward()
        opt.step()
        kinds.add(opt.last_step_kind.value)
        assert "variance_views" not in {k for k, b in state_bytes(opt).items() if b > 1024}  # released by step()
    monkeypatch.undo()
    return [p.detach().clone() for p in model.parameters()], kinds


@pytest.mark.parametrize(
    "cls, kwargs",
    [(OneBitAdam, {"freeze_step": 6}), (ZeroOneAdam, {"var_freeze_step": 12, "exact_warmup_steps": 2})],
)
def test_reusing_what_a_frozen_variance_gives_changes_no_bit_of_training(cls, kwargs, monkeypatch):
    cached, kinds = _train(cls, kwargs, True, monkeypatch)
    fresh, _ = _train(cls, kwargs, False, monkeypatch)
    assert len(kinds) >= 2, kinds  # the run reached the frozen-variance steps
    assert all(torch.equal(a, b) for a, b in zip(cached, fresh))


def _hooked_steps(rank, cls_name, kwargs, step):
    """40 steps through the DDP hook on 2 ranks (several buckets), ``step(opt)`` taking each: the final parameters."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_zeroone
    from hf_zeroone import register_zeroone_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets
    opt = getattr(hf_zeroone, cls_name)(ddp.parameters(), lr=1e-2, **kwargs)
    register_zeroone_hook(ddp, opt)
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(40):
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        (ddp(x) - x.flip(1)).pow(2).mean().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(opt)
    return [p.detach().clone() for p in model.parameters()]


def _train_two_ranks(rank, world, cls_name, kwargs, cached):
    """Through the DDP hook on 2 ranks (1-bit messages in update units, lanes, error buffers): final parameters."""
    if not cached:
        VarianceViews._valid = staticmethod(lambda table, p, key: None)
    kinds = set()

    def step(opt):
        opt.step()
        kinds.add(opt.last_step_kind.value)

    return _hooked_steps(rank, cls_name, kwargs, step), sorted(kinds)


@pytest.mark.parametrize(
    "cls_name, kwargs",
    [("OneBitAdam", {"freeze_step": 6}), ("ZeroOneAdam", {"var_freeze_step": 24, "exact_warmup_steps": 2})],
)
def test_through_the_hook_on_two_ranks_reusing_them_changes_no_bit(cls_name, kwargs):
    from _dist import run_ranks

    cached, kinds = run_ranks(_train_two_ranks, 2, cls_name, kwargs, True)[0]
    fresh, _ = run_ranks(_train_two_ranks, 2, cls_name, kwargs, False)[0]
    assert len(kinds) >= 2, kinds  # the frozen-variance kinds were reached
    assert all(torch.equal(a, b) for a, b in zip(cached, fresh))


def test_scale_samples_count_exactly_the_elements_at_or_above_the_idle_floor():
    """The samples' definition, element by element: an element exactly at the floor takes part."""
    from hf_zeroone.optim import _grad_scale

    gen = torch.Generator().manual_seed(0)
    dens = [torch.rand(n, generator=gen) + 0.5 for n in (7, 300, 1000)]
    dens[1][:40] = 1e-4  # idle: far below a tenth of the mean
    for _ in range(20):  # five elements exactly at the floor (active), which moves the mean a little
        means, counts, idle = _grad_scale.sample_statistics(dens)
        floor = means[2] * _grad_scale.IDLE_BELOW
        if torch.equal(dens[2][:5], floor.expand(5)):
            break
        dens[2][:5] = floor
    assert torch.equal(dens[2][:5], floor.expand(5))
    grads = [torch.randn(d.shape, generator=gen) for d in dens]
    want = []
    for g, d, mean, count in zip(grads, dens, means, counts):
        active = d >= mean * _grad_scale.IDLE_BELOW
        want.append(((g[active] / d[active]) ** 2).sum() / count)
    assert counts.tolist() == [7, 260, 1000]
    for flags in (None, idle.tolist()):  # every tensor masked, or only those with idle elements
        got = _grad_scale.scale_samples(grads, dens, means, counts, flags)
        torch.testing.assert_close(got, torch.stack(want), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale_samples_mask_the_float_just_below_the_floor_and_keep_the_one_at_it(dtype):
    """An element exactly at its tensor's floor takes part, the float just below it does not (float32 and float64)."""
    from hf_zeroone.optim import _grad_scale

    gen = torch.Generator().manual_seed(1)
    dens = [(torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(dtype) for n in (5, 64, 33)]
    means = torch.tensor([1.0, 3.0, 0.7], dtype=torch.float32)  # given, not measured: the floors are known
    floors = (means * _grad_scale.IDLE_BELOW).to(dtype)
    for d, floor in zip(dens, floors):
        d[0] = floor
        d[1] = torch.nextafter(floor, torch.tensor(-1.0, dtype=dtype))
        d[2] = torch.nextafter(floor, torch.tensor(9.0, dtype=dtype))
        d[3] = floor / 1000
    grads = [torch.randn(d.shape, generator=gen) for d in dens]
    counts = torch.tensor([float((d >= f).sum()) for d, f in zip(dens, floors)])
    want = []
    for g, d, floor, count in zip(grads, dens, floors, counts):
        r = torch.div(g, d).masked_fill_(d < floor, 0.0)
        want.append(torch.linalg.vector_norm(r).square() / count)
    got = _grad_scale.scale_samples(grads, dens, means, counts, None)
    assert counts.tolist() == [3, 62, 31]
    assert torch.equal(got, torch.stack(want))


@pytest.mark.parametrize(
    ("options", "shared"),
    [({}, True), ({"clip_to_variance": False}, False), ({"follow_gradient_scale": False}, False)],
)
def test_plain_denominators_are_shared_only_where_the_step_reads_them(monkeypatch, options, shared):
    """One sqrt(v) for the scaled and the plain denominators, offered only where the samples come after.

    Without clipping the samples are taken before the update asks for the scaled denominators: a
    plain set offered then was never read (4 bytes per parameter held to the end of the step).
    """
    from hf_zeroone import OneBitAdam
    from hf_zeroone.optim._variance_views import VarianceViews

    offered, read = [], []
    real_offer, real_statistics = VarianceViews.offer, VarianceViews.statistics

    def offer(self, params, *args):
        offered.append(len(params))
        return real_offer(self, params, *args)

    def statistics(self, params, *args):
        read.append(len(params))
        return real_statistics(self, params, *args)

    monkeypatch.setattr(VarianceViews, "offer", offer)
    monkeypatch.setattr(VarianceViews, "statistics", statistics)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2, **options)
    for step in range(6):
        x = torch.randn(16, 8)
        model(x).pow(2).mean().backward()
        if step == 4:
            offered.clear(), read.clear()
        opt.step()
        opt.zero_grad()
    assert opt.last_step_kind.value == "onebit_momentum"
    assert bool(offered) is shared
    if offered:  # each offered set was then looked up by the samples
        assert read and sum(offered) == sum(read)
