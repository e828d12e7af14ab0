"""How the DDP hook tells one iteration from the next (2 gloo ranks).

Gradient accumulation with and without ``no_sync()``, a GradScaler's skipped step, and a forward
between backward and ``step()``.

A loop written for AdamW often accumulates without ``no_sync()``: DDP then averages every micro-step,
which costs AdamW bandwidth but not correctness. The hook used to run a compressed exchange on every
backward pass, so one step sent several messages built on one momentum and error state: 1-bit Adam
ended this file's regression 15% above the same loop under ``no_sync()`` (0.887 against 0.769), and a
60-step regression of a 2-layer tanh network 20x above it (1.79 against 0.086); 0/1 Adam sent an
exchange per pass. The hook now learns the number of passes per step and combines once, on the
last (see ``hf_zeroone.ddp_hook``).
"""

import pytest
import torch

from _dist import run_ranks

ACCUMULATE = 2


def _train(rank, world, name, no_sync, passes=None, steps=40):
    """Regression with ``ACCUMULATE`` micro-steps per step (``passes[i]`` at step ``i`` when given)."""
    import contextlib
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam, register_zeroone_hook

    from _workloads import batches, eval_loss, flat_params, loss_fn, make_model

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.004)  # several buckets
    # fp32 exact steps: the step where the hook learns about the accumulation averages some of it
    # twice, which is exact in fp32 only; the runs with and without no_sync() then stay close
    if name == "onebit":
        opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=5, exact_step_dtype="float32")
    else:
        opt = ZeroOneAdam(ddp.parameters(), lr=1e-2, var_freeze_step=5, exact_step_dtype="float32")
    state = register_zeroone_hook(ddp, opt)
    passes = passes or [ACCUMULATE] * steps
    data = iter(batches(rank, sum(passes), batch=32))
    losses, per_step, snaps = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for count in passes:
            for k in range(count):
                x, y = next(data)
                quiet = ddp.no_sync() if no_sync and k < count - 1 else contextlib.nullcontext()
                with quiet:
                    loss = loss_fn(ddp, x, y) / count
                    loss.backward()
                losses.append(loss.item() * count)
            opt.step()
            ddp.zero_grad()  # as transformers.Trainer does: the optimizer's zero_grad() is not called
            per_step.append((opt.last_step_kind.value, opt.last_step_stats.bytes_sent, opt.last_step_stats.collectives))
            snaps.append(flat_params(model))
    return {
        "loss": sum(losses[-20:]) / 20,
        "held_out": eval_loss(model, world),
        "per_step": per_step,
        "snaps": snaps,
        "passes": getattr(state, "backward_passes_per_step", None),
        "warnings": [str(w.message) for w in caught],
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_accumulating_without_no_sync_trains_as_with_it(name):
    plain = run_ranks(_train, 2, name, False, timeout=200)
    quiet = run_ranks(_train, 2, name, True, timeout=200)
    # the outcome a user sees: the loss of the no_sync() loop (before the fix, 1-bit Adam's was 20x it)
    # (1-bit signs of near-zero values flip on last-bit differences: losses, not parameters, compare)
    print(name, plain[0]["loss"], quiet[0]["loss"], plain[0]["held_out"], quiet[0]["held_out"])
    assert plain[0]["loss"] == pytest.approx(quiet[0]["loss"], rel=0.05), (plain[0]["loss"], quiet[0]["loss"])
    assert plain[0]["held_out"] == pytest.approx(quiet[0]["held_out"], rel=0.05)
    kinds = {kind for kind, _, _ in plain[0]["per_step"]}
    assert {"onebit_momentum"} <= kinds if name == "onebit" else {"local", "onebit_sync"} <= kinds
    # one combination per step from the second step on: the bytes and collectives of no_sync(), exactly
    assert plain[0]["per_step"][1:] == quiet[0]["per_step"][1:]
    assert plain[0]["passes"] == ACCUMULATE and quiet[0]["passes"] is None
    said = [w for w in plain[0]["warnings"] if "no_sync" in w]
    assert len(said) == 1 and "again before optimizer.step()" in said[0]
    assert not quiet[0]["warnings"]
    if name == "onebit":  # every step of 1-bit Adam leaves the replicas identical
        for a, b in zip(plain[0]["snaps"], plain[1]["snaps"]):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_three_passes_and_shorter_steps_combine_once_per_step():
    passes = [3, 3, 3, 2] * 5 + [3, 1, 3]  # an epoch's last step has fewer micro-batches
    plain = run_ranks(_train, 2, "onebit", False, passes, timeout=200)
    quiet = run_ranks(_train, 2, "onebit", True, passes, timeout=200)
    assert plain[0]["passes"] == 3
    for a, b in zip(plain[0]["snaps"], plain[1]["snaps"]):
        assert torch.equal(a, b)
    # full steps: the hook's single exchange from the second step on, as under no_sync(); short ones
    # are left to step() (its own buckets): one 1-bit exchange each after the freeze
    full = [i for i, count in enumerate(passes) if count == 3]
    assert [plain[0]["per_step"][i] for i in full[1:]] == [quiet[0]["per_step"][i] for i in full[1:]]
    after = list(zip(plain[0]["per_step"], passes))[6:]
    assert all(kind == "onebit_momentum" and sent > 0 for (kind, sent, _), _ in after)
    assert len({stats for stats, count in after if count < 3}) == 1
    said = plain[0]["warnings"]
    assert len([w for w in said if "no_sync" in w]) == 1 and not [w for w in said if "no hf_zeroone DDP hook" in w]


@pytest.mark.slow
def test_a_loop_that_stops_accumulating_is_combined_in_the_hook_again():
    passes = [2] * 4 + [1] * 6
    plain = run_ranks(_train, 2, "onebit", False, passes, timeout=200)
    quiet = run_ranks(_train, 2, "onebit", True, passes, timeout=200)
    assert plain[0]["passes"] is None  # three steps of one pass in a row: no accumulation any more
    assert plain[0]["per_step"][7:] == quiet[0]["per_step"][7:]  # the hook's exchange, not step()'s
    for a, b in zip(plain[0]["snaps"], plain[1]["snaps"]):
        assert torch.equal(a, b)


def _scaler_skips(rank, world, passes=None, bad=(1, 5)):
    """fp16 autocast and a GradScaler told to the hook; steps ``bad`` overflow on rank 1 and are skipped.

    ``passes``: backward passes per step, accumulated without no_sync() (default: one each).
    """
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    state = register_zeroone_hook(ddp, opt, grad_scaler=scaler)
    advanced, snaps = [], []
    passes = passes or [1] * 10
    data = iter(batches(rank, sum(passes), batch=32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, count in enumerate(passes):
            for _ in range(count):
                x, y = next(data)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = loss_fn(ddp, x, y) / count
                scaled = scaler.scale(loss)
                if rank == 1 and i in bad:
                    scaled = scaled * float("inf")
                scaled.backward()
            before = opt.schedule["step"]
            scaler.step(opt)
            scaler.update()
            ddp.zero_grad()  # not the optimizer's: a skipped step then looks like a second backward pass
            advanced.append(opt.schedule["step"] - before)
            snaps.append(flat_params(model))
    return advanced, state.backward_passes_per_step, [str(w.message) for w in caught], snaps


@pytest.mark.slow
def test_a_gradscaler_skip_is_not_taken_for_accumulation():
    res = run_ranks(_scaler_skips, 2, timeout=200)
    for advanced, passes, said, _ in res:
        assert advanced == [1, 0, 1, 1, 1, 0, 1, 1, 1, 1]
        assert passes is None
        assert not [w for w in said if "no_sync" in w]


@pytest.mark.slow
def test_a_gradscaler_skip_of_a_short_accumulated_step_is_skipped_on_every_rank():
    # the short step is left to step(), after the scaler reads the local gradients: the hook makes
    # the ranks agree on the overflow, or rank 1 alone would skip and rank 0 wait in step()
    res = run_ranks(_scaler_skips, 2, [2, 2, 2, 1, 2, 2, 2, 2], (3,), timeout=200)
    for advanced, passes, said, _ in res:
        assert advanced == [1, 1, 1, 0, 1, 1, 1, 1]
        assert passes == 2  # the skip is not taken for a third pass
        assert len([w for w in said if "no_sync" in w]) == 1
    for a, b in zip(res[0][3], res[1][3]):
        assert torch.equal(a, b)


def test_the_outputs_a_backward_can_reach_are_found_and_hooked_once():
    from collections import OrderedDict

    from hf_zeroone._iterations import forget_results_on_next_backward, tensors_in

    x = torch.randn(3, 4, requires_grad=True)
    y = x * 2
    assert len(tensors_in(torch.topk(y, 2, dim=1))) == 2  # a torch.return_types tuple
    assert len(tensors_in(OrderedDict(loss=y.sum(), logits=y, extra=[y, (y, None)]))) == 4
    assert tensors_in(object()) == [] and tensors_in(None) == []
    forgotten = []
    hook = forget_results_on_next_backward(lambda: forgotten.append(1))
    hook(None, (), object())  # an output it cannot look into: forgotten at once
    assert forgotten == [1]
    with torch.no_grad():
        hook(None, (), x * 3)  # no backward can reach it
    out = x * 4
    for _ in range(3):  # the same tensor returned again gets one hook
        hook(None, (), {"out": out, "leaf": x})
    assert forgotten == [1]
    out.sum().backward()
    assert forgotten == [1, 1]


def _forward_before_step(rank, world, name, extra_forward):
    """A loop that runs the model once more between backward and step(), e.g. to log a prediction."""
    import warnings

    from _workloads import batches, flat_params, hooked_default_run, loss_fn

    model, ddp, opt = hooked_default_run(name, 30)
    kinds = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(rank, 30):
            loss_fn(ddp, x, y).backward()
            if extra_forward == "no_grad":
                with torch.no_grad():
                    ddp(x[:4])
            elif extra_forward == "grad":  # a loss computed and never backpropagated
                loss_fn(ddp, x[:4], y[:4])
            opt.step()
            opt.zero_grad()
            kinds.add(opt.last_step_kind.value)
    return flat_params(model), opt.comm_stats.bytes_sent, kinds, [str(w.message) for w in caught]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_forward_between_backward_and_step_changes_nothing(name):
    plain = run_ranks(_forward_before_step, 2, name, None, timeout=200)
    assert {"exact", "onebit_momentum" if name == "onebit" else "onebit_sync"} <= plain[0][2]
    for extra in ("no_grad", "grad"):
        # before the fix, the forward made step() combine the combined gradients again: 1-bit Adam
        # ended a 60-step run 46% above the loop without it, and both warned that no hook ran
        res = run_ranks(_forward_before_step, 2, name, extra, timeout=200)
        assert torch.equal(res[0][0], plain[0][0]) and torch.equal(res[1][0], plain[1][0]), extra
        assert res[0][1] == plain[0][1]
        assert not res[0][3], res[0][3]


def _resume(rank, world, name, before):
    """Accumulate 2 passes per step without ``no_sync()`` for ``before`` steps, checkpoint, go on in new objects.

    The hook learns the passes per step on the first step; after the checkpoint, a fresh model,
    optimizer and hook load it and train on the same way.
    """
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam, register_zeroone_hook

    from _workloads import batches, loss_fn, make_model

    def build():
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.004)
        cls, kw = (OneBitAdam, {"freeze_step": 3}) if name == "onebit" else (ZeroOneAdam, {"var_freeze_step": 3})
        opt = cls(ddp.parameters(), lr=1e-2, exact_step_dtype="float32", **kw)
        return model, ddp, opt, register_zeroone_hook(ddp, opt)

    data = iter(batches(rank, 2 * (before + 8), batch=32))

    def train(ddp, opt, steps):
        stats = []
        for _ in range(steps):
            for _ in range(2):
                x, y = next(data)
                (loss_fn(ddp, x, y) / 2).backward()
            opt.step()
            ddp.zero_grad()
            stats.append((opt.last_step_kind.value, opt.last_step_stats.bytes_sent, opt.last_step_stats.collectives))
        return stats

    model, ddp, opt, _ = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(ddp, opt, before)
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    model, ddp, opt, state = build()
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    loaded = state.backward_passes_per_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = train(ddp, opt, 8)
    return {"loaded": loaded, "stats": stats, "warnings": [str(w.message) for w in caught]}


@pytest.mark.slow
@pytest.mark.parametrize("before", [1, 6])  # right after the step that learned the count, and later
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_resumed_run_keeps_the_learned_passes_per_step(name, before):
    """The passes per step live in the optimizer's checkpoint: a resumed loop combines once per step at once.

    Before, a resumed run learned them again: its first step warned, and sent a second exchange
    from ``step()`` after the hook's (its first pass was combined in the hook).
    """
    resumed = run_ranks(_resume, 2, name, before, timeout=200)[0]
    assert resumed["loaded"] == 2
    assert not resumed["warnings"], resumed["warnings"]
    # one exchange in every step: each kind's steps make the same collectives, the first resumed one
    # too (DDP rebuilds its buckets after the first iteration, so its bytes may differ)
    by_kind: dict = {}
    for kind, _, collectives in resumed["stats"]:
        by_kind.setdefault(kind, set()).add(collectives)
    assert all(len(counts) == 1 for counts in by_kind.values()), resumed["stats"]
    assert ("onebit_momentum" if name == "onebit" else "local") in by_kind


def test_loading_a_checkpoint_forgets_that_a_hook_deferred_steps():
    """A checkpoint without learned passes per step brings back the "no hook ran" warning (the hook sets it again)."""
    from hf_zeroone import OneBitAdam

    params = [torch.nn.Parameter(torch.zeros(4))]
    saved = OneBitAdam(params, lr=1e-3, freeze_step=2).state_dict()
    opt = OneBitAdam(params, lr=1e-3, freeze_step=2)
    opt.hook_defers_some_steps = True  # as a hook that learned a count before the load
    opt.load_state_dict(saved)
    assert opt.hook_defers_some_steps is False
    assert "backward_passes_per_step" not in opt.schedule
