"""The DDP communication hook on 2 gloo ranks."""

import pytest
import torch

from _dist import run_ranks


def _opt(name, params, **kw):
    """The papers' maths unless told otherwise: exact steps in fp32, 0/1 Adam's 1-bit gradients from its second gap."""
    from hf_zeroone import OneBitAdam, ZeroOneAdam

    kw.setdefault("exact_step_dtype", "float32")
    if name == "onebit":
        return OneBitAdam(params, lr=1e-2, weight_decay=0.01, freeze_step=kw.pop("freeze_step", 3), **kw)
    return ZeroOneAdam(
        params,
        lr=1e-2,
        weight_decay=0.01,
        var_freeze_step=kw.pop("var_freeze_step", 12),
        var_update_scaler=2,
        local_step_scaler=3,
        local_step_clipper=4,
        **{"exact_warmup_steps": 0, **kw},
    )


class _WithBf16Gain(torch.nn.Module):
    """A float32 model times the mean of a bf16 parameter: a model of two dtypes (two DDP buckets)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.gain = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.gain.float().mean()


def _cast(model: torch.nn.Module, model_dtype) -> torch.nn.Module:  # noqa: ANN001
    if model_dtype == "mixed":
        return _WithBf16Gain(model)
    return model if model_dtype is None else model.to(model_dtype)


def _equivalence(rank, world, extra=None, model_dtype=None):
    """Single bucket: hook path == optimizer path, bit for bit; exact phase == DDP without hook.

    ``extra``: keyword arguments for both optimizers (e.g. ``exact_step_dtype``); ``model_dtype``:
    both models and their inputs cast to it (e.g. ``torch.bfloat16``), or ``"mixed"``: float32
    models with one bf16 parameter.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    out = {}
    data = batches(rank, 30)
    if isinstance(model_dtype, torch.dtype):
        data = [(x.to(model_dtype), y.to(model_dtype)) for x, y in data]
    for name in ("onebit", "zeroone"):
        ma = _cast(make_model(), model_dtype)
        ddp = DDP(ma, bucket_cap_mb=100)
        # DDP's single bucket holds the parameters in reverse order: give the optimizer path the same.
        oa = _opt(name, list(ddp.parameters())[::-1], **(extra or {}))
        register_zeroone_hook(ddp, oa)
        mb = _cast(make_model(), model_dtype)
        ob = _opt(name, list(mb.parameters())[::-1], **(extra or {}))
        diffs, kinds, stats, step_stats = [], [], [], []
        for x, y in data:
            oa.zero_grad()
            loss_fn(ddp, x, y).backward()
            oa.step()
            ob.zero_grad()
            loss_fn(mb, x, y).backward()
            ob.step()
            diffs.append(bool(torch.equal(flat_params(ma), flat_params(mb))))
            kinds.append(oa.last_step_kind.value)
            stats.append(oa.last_step_stats.as_dict())
            step_stats.append(ob.last_step_stats.as_dict())
        out[name] = {
            "equal": diffs,
            "kinds": kinds,
            "stats": stats,
            "step_stats": step_stats,
            "numel": sum(p.numel() for p in ma.parameters()),
            "sizes": [p.numel() for p in ma.parameters()],
        }

    if extra or model_dtype is not None:
        return out
    # Exact phase: gradients after the hook equal those of DDP without a hook.
    m1, m2 = make_model(), make_model()
    d1, d2 = DDP(m1), DDP(m2)
    register_zeroone_hook(d1, _opt("onebit", d1.parameters(), freeze_step=100))
    x, y = data[0]
    loss_fn(d1, x, y).backward()
    loss_fn(d2, x, y).backward()
    out["grad_max_diff"] = max((a.grad - b.grad).abs().max().item() for a, b in zip(m1.parameters(), m2.parameters()))
    return out


@pytest.fixture(scope="module")
def equivalence():
    return run_ranks(_equivalence, 2, timeout=200)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_hook_path_equals_optimizer_path_bit_for_bit(equivalence, name):
    res = equivalence[0][name]
    assert all(res["equal"]), res["equal"]
    assert {"exact", "onebit_momentum"} <= set(res["kinds"]) or {
        "onebit_gradient",
        "local",
        "onebit_sync",
    } <= set(res["kinds"])


@pytest.mark.slow
def test_exact_phase_gradients_equal_plain_ddp(equivalence):
    for r in equivalence:
        assert r["grad_max_diff"] < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_per_step_bytes_follow_the_schedule(equivalence, name):
    from hf_zeroone.comm import fp32_allreduce_bytes
    from hf_zeroone.compression import padded_length

    res = equivalence[0][name]
    n = res["numel"]
    for kind, stats in zip(res["kinds"], res["stats"]):
        if kind == "local":
            assert stats["bytes_sent"] == 0 and stats["collectives"] == 0
        elif kind == "exact":  # the bucket and, in the same allreduce, one float per tensor (6) for
            # follow_gradient_scale
            assert stats["bytes_sent"] == fp32_allreduce_bytes(n + 6, 2)
            assert stats["collectives"] == 1
        else:  # one bucket: signs of the padded vector + one scale per segment, both stages
            signs = 2 * (2 - 1) * padded_length(n, 2) // 2 // 8
            # 1-bit Adam also averages two floats per tensor (6 tensors) exactly, in the same two
            # collectives: the squared norms that keep p.grad gradient-sized, and the scale samples
            # of follow_gradient_scale (each rank serves half of them: 6 floats per stage)
            lane = 2 * (2 - 1) * 4 * 6 if kind == "onebit_momentum" else 0
            assert stats["collectives"] == 2
            assert signs + lane < stats["bytes_sent"] <= signs + lane + 2 * 4 * (6 + 2)  # scales: <= 6 + 2
            assert stats["fp32_equivalent_bytes"] / stats["bytes_sent"] > 20


def _ddp_variants(rank, world, variant):
    """Train with the hook under one DDP configuration; snapshot parameters after syncing steps."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    out = {}
    for name in ("onebit", "zeroone"):
        model = make_model(embedding_rows=4, unused_layer=variant == "find_unused")
        if variant == "bf16":
            model = model.to(torch.bfloat16)
        kwargs = dict(bucket_cap_mb=0.004)
        if variant in ("static_graph", "before_rebuild"):
            kwargs["static_graph"] = True
        if variant == "find_unused":
            kwargs["find_unused_parameters"] = True
        if variant == "bucket_view":
            kwargs["gradient_as_bucket_view"] = True
        ddp = DDP(model, **kwargs)
        # "before_rebuild": compress at iteration 1, before a static-graph DDP rebuilds its buckets.
        first = 1 if variant == "before_rebuild" else 2
        opt = _opt(name, ddp.parameters(), **({"freeze_step": first} if name == "onebit" else {"var_freeze_step": 8}))
        register_zeroone_hook(ddp, opt)
        snaps, losses = [], []
        for x, y in batches(rank, 24):
            if variant == "bf16":
                x, y = x.bfloat16(), y.bfloat16()
            opt.zero_grad()
            if variant == "no_sync":
                half = x.shape[0] // 2
                with ddp.no_sync():
                    (loss_fn(ddp, x[:half], y[:half]) / 2).backward()
                loss = loss_fn(ddp, x[half:], y[half:]) / 2
            else:
                loss = loss_fn(ddp, x, y)
            loss.backward()
            if variant == "clip":
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
            opt.step()
            losses.append(float(loss))
            if opt.last_step_kind.communicates:
                snaps.append(flat_params(model))
        out[name] = {"snaps": torch.stack(snaps), "losses": losses}
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        "several_buckets",
        "before_rebuild",
        "no_sync",
        "static_graph",
        "find_unused",
        "bucket_view",
        "bf16",
        "clip",
    ],
)
def test_replicas_identical_under_ddp_options(variant):
    res = run_ranks(_ddp_variants, 2, variant, timeout=200)
    for name in ("onebit", "zeroone"):
        a, b = res[0][name], res[1][name]
        assert torch.equal(a["snaps"], b["snaps"]), (variant, name)
        assert all(torch.isfinite(torch.tensor(a["losses"])))
        assert sum(a["losses"][-8:]) < sum(a["losses"][:8]), (variant, name, a["losses"])


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


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_dtype, exact_step_dtype",
    [
        (torch.bfloat16, None),
        (torch.bfloat16, "bfloat16"),
        (torch.bfloat16, "float8_e4m3fn"),
        (torch.bfloat16, "float32"),
        ("mixed", None),
        ("mixed", "float8_e4m3fn"),
    ],
)
def test_a_bf16_model_hook_equals_step_and_sends_the_same_bytes(model_dtype, exact_step_dtype):
    """bf16 parameters: the hook and ``step()`` agree bit for bit and send the same bytes, every step kind.

    DDP's bucket is bf16, so the hook hands the 1-bit momentum's implied gradient back in bf16 and
    sends an exact step as it is; ``step()`` rounds and sends the same. A model of two dtypes
    ("mixed": fp32 with one bf16 parameter) has a bucket of each in DDP; ``step()`` sends each
    dtype's exact message on its own too.
    """
    res = run_ranks(_equivalence, 2, {"exact_step_dtype": exact_step_dtype}, model_dtype, timeout=200)[0]
    for name, compressed in (("onebit", "onebit_momentum"), ("zeroone", "onebit_gradient")):
        assert {"exact", compressed} <= set(res[name]["kinds"]), res[name]["kinds"]
        assert all(res[name]["equal"]), (name, list(zip(res[name]["kinds"], res[name]["equal"])))
        pairs = list(zip(res[name]["kinds"], res[name]["stats"], res[name]["step_stats"]))
        if model_dtype == "mixed":  # DDP's two buckets against step()'s one: compressed steps count apart
            pairs = [p for p in pairs if p[0] == "exact"]
        assert all(hook == step for _, hook, step in pairs), (name, pairs)


@pytest.fixture(scope="module")
def equivalence_float8():
    return run_ranks(_equivalence, 2, {"exact_step_dtype": "float8_e4m3fn"}, timeout=200)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_float8_exact_steps_hook_equals_step_in_two_collectives_of_a_quarter_of_the_bytes(
    equivalence_float8, equivalence, name
):
    """exact_step_dtype=float8_e4m3fn: both paths agree bit for bit; an exact step sends a byte per element.

    Its all-to-all and all-gather carry each element's code, a float32 scale per 128 elements and
    the exact lane (the scale samples, six floats here, exact); compressed steps are unchanged.
    """
    from hf_zeroone._two_stage import float8_row_bytes

    res, fp32 = equivalence_float8[0][name], equivalence[0][name]
    assert all(res["equal"]), res["equal"]
    assert res["kinds"] == fp32["kinds"]
    exact = [s for k, s in zip(res["kinds"], res["stats"]) if k == "exact"]
    assert exact
    for stats in exact:
        assert stats["bytes_sent"] == 2 * float8_row_bytes(res["sizes"], 6, 2)
        assert stats["collectives"] == 2
    for kind, stats, before in zip(res["kinds"], res["stats"], fp32["stats"]):
        if kind != "exact":
            assert stats["bytes_sent"] == before["bytes_sent"] and stats["collectives"] == before["collectives"]


@pytest.fixture(scope="module")
def equivalence_bf16():
    return run_ranks(_equivalence, 2, {"exact_step_dtype": "bfloat16"}, timeout=200)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_bf16_exact_steps_hook_equals_step_and_halve_the_bytes(equivalence_bf16, equivalence, name):
    """exact_step_dtype=bfloat16: both paths still agree bit for bit; an exact step sends half the bytes.

    The scale samples of follow_gradient_scale (one float per tensor) ride in the same
    collective, in bf16 too; the compressed steps are unchanged.
    """
    from hf_zeroone.comm import fp32_allreduce_bytes

    res, fp32 = equivalence_bf16[0][name], equivalence[0][name]
    assert all(res["equal"]), res["equal"]
    assert res["kinds"] == fp32["kinds"]
    n = res["numel"]
    exact = [s for k, s in zip(res["kinds"], res["stats"]) if k == "exact"]
    assert exact
    for stats in exact:
        assert stats["bytes_sent"] == fp32_allreduce_bytes(n + 6, 2, 2)
        assert stats["fp32_equivalent_bytes"] == fp32_allreduce_bytes(n + 6, 2)
        assert stats["collectives"] == 1
    for kind, stats, before in zip(res["kinds"], res["stats"], fp32["stats"]):
        if kind != "exact":
            assert stats["bytes_sent"] == before["bytes_sent"] and stats["collectives"] == before["collectives"]
