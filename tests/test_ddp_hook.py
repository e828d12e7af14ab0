"""The DDP communication hook on 2 gloo ranks."""

import pytest
import torch

from _dist import run_ranks
from _workloads import hook_test_optimizer as _opt


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
