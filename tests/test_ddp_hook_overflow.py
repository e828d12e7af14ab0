"""The DDP hook on 2 gloo ranks when a rank's gradients overflow, and with a GradScaler's loss scale."""

import pytest
import torch

from _dist import run_ranks
from _workloads import hook_test_optimizer as _opt


def _overflow(rank, world, name, told):
    """Autocast fp16 + GradScaler; rank 1 gets an inf gradient at chosen steps.

    ``told``: ``"flag"`` sets ``overflow_check_on_local_steps``; ``"scaler"`` only hands the
    GradScaler to ``register_zeroone_hook``, which must be enough.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    opt = _opt(name, ddp.parameters(), **({"freeze_step": 2} if name == "onebit" else {"var_freeze_step": 6}))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    if told == "flag":
        register_zeroone_hook(ddp, opt).overflow_check_on_local_steps = True
    else:
        register_zeroone_hook(ddp, opt, grad_scaler=scaler)
    bad_steps = {1, 4, 8, 9, 10}
    record = []
    for i, (x, y) in enumerate(batches(rank, 16)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(ddp, x, y)
        scaled = scaler.scale(loss)
        if rank == 1 and i in bad_steps:
            scaled = scaled * float("inf")
        kind = opt.next_step_kind().value
        scaled.backward()
        step_before = opt.schedule["step"]
        scaler.step(opt)
        scaler.update()
        errors_finite = all(
            bool(torch.isfinite(s[k]).all())
            for s in opt.state.values()
            for k in ("worker_error", "server_error")
            if k in s
        )
        record.append((i, kind, opt.schedule["step"] - step_before, errors_finite, flat_params(model)))
    return record


@pytest.mark.slow
@pytest.mark.parametrize("told", ["flag", "scaler"])
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_overflow_on_one_rank_makes_every_rank_skip(name, told):
    res = run_ranks(_overflow, 2, name, told, timeout=200)
    kinds_seen = set()
    for (i, kind, adv0, fin0, p0), (_, _, adv1, fin1, p1) in zip(res[0], res[1]):
        kinds_seen.add(kind)
        assert adv0 == adv1, (i, kind)  # both stepped or both skipped
        assert fin0 and fin1
        assert torch.equal(p0, p1) or kind == "local"
    skipped = [i for i, kind, adv, *_ in res[0] if adv == 0]
    assert {1, 4} <= set(skipped)
    assert torch.isfinite(res[0][-1][4]).all()
    assert len(skipped) < len(res[0])  # training went on


def _inf_overflow(rank, world, name):
    """Hook + GradScaler; every gradient of rank 1 is a plain +inf on the first two compressed steps.

    The model has an embedding whose rows 1.. never get a gradient (masked rows).
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone.ddp_hook import register_zeroone_hook
    from hf_zeroone.optim import _masks

    from _workloads import batches, flat_params, loss_fn, make_model

    model = make_model(embedding_rows=10)
    ddp = DDP(model, bucket_cap_mb=0.004)
    opt = _opt(name, ddp.parameters(), **({"freeze_step": 2} if name == "onebit" else {"var_freeze_step": 12}))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    register_zeroone_hook(ddp, opt, grad_scaler=scaler)
    record, compressed = [], 0
    for i, (x, y) in enumerate(batches(rank, 10)):
        opt.zero_grad()
        kind = opt.next_step_kind()
        bad = kind.compressed and compressed < 2
        compressed += kind.compressed
        handles = []
        if bad and rank == 1:  # an overflow that is inf alone, no NaN (as in the backward of a huge loss)
            handles = [p.register_hook(lambda g: torch.full_like(g, float("inf"))) for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(ddp, x, y)
        scaler.scale(loss).backward()
        for h in handles:
            h.remove()
        before = opt.schedule["step"]
        scaler.step(opt)
        scaler.update()
        record.append((i, kind.value, bad, opt.schedule["step"] - before))
    state = opt.state[model.extra.weight]
    masked = int(_masks.masked_rows(state).sum()) if "momentum_mask" in state else 0
    return record, flat_params(model), scaler.get_scale(), masked


@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_plain_inf_overflow_on_one_rank_is_skipped_on_every_rank(name):
    """Clipping to the variance bounded a +inf gradient in the hook's 1-bit message: the step went on.

    The ranks stayed identical, but a step the scaler should have skipped was taken with a
    clipped message, and the scaler did not back off. The hook now sends such a bucket as NaN, which
    must not count as activity in masked rows (the embedding's 9 unseen rows stay masked).
    """
    (rec0, params0, scale0, masked0), (rec1, params1, scale1, masked1) = run_ranks(_inf_overflow, 2, name, timeout=200)
    assert [r[:2] for r in rec0] == [r[:2] for r in rec1]
    bad = [r for r in rec0 if r[2]]
    assert len(bad) == 2 and all(kind.startswith("onebit") for _, kind, _, _ in bad), rec0
    for (i, kind, was_bad, adv0), (_, _, _, adv1) in zip(rec0, rec1):
        assert adv0 == adv1 == (0 if was_bad else 1), (i, kind, adv0, adv1)
    assert torch.equal(params0, params1) and torch.isfinite(params0).all()
    assert scale1 < 2.0**8
    assert masked0 == masked1 == 9


def _with_scaler(rank, world, init_scale, growth):
    """Train with the hook and a GradScaler; the loss scale must not change the trajectory."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    out = {}
    for name in ("onebit", "zeroone"):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.004)
        opt = _opt(name, ddp.parameters(), **({"freeze_step": 2} if name == "onebit" else {"var_freeze_step": 10}))
        # growth: the scale doubles after every step (it changes under the error buffers); else constant
        interval = 1 if growth else 10**6
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0, growth_interval=interval)
        register_zeroone_hook(ddp, opt, grad_scaler=scaler)
        kinds = set()
        for x, y in batches(rank, 12):
            opt.zero_grad()
            kinds.add(opt.next_step_kind().value)
            scaler.scale(loss_fn(ddp, x, y)).backward()
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() == (init_scale * 2**12 if growth else init_scale)  # no step was skipped
        out[name] = (kinds, flat_params(model))
    return out


@pytest.mark.slow
def test_compressed_steps_do_not_depend_on_the_loss_scale():
    runs = [
        run_ranks(_with_scaler, 2, s, growth, timeout=120)
        for s, growth in ((1.0, False), (2.0**16, False), (16.0, True))
    ]
    for name, kind in (("onebit", "onebit_momentum"), ("zeroone", "onebit_gradient")):
        reference = runs[0][0][name][1]
        assert kind in runs[0][0][name][0]
        for res in runs:  # scaling by powers of two is exact, so the runs agree bit for bit
            assert torch.equal(res[0][name][1], reference) and torch.equal(res[1][name][1], reference), name
