"""Ranks that built their optimizer differently get a clear error on every rank at the first step.

Before the check, a different ``freeze_step`` made gloo abort the process ("Received data size
doesn't match expected size", no Python traceback), a different ``exact_step_dtype`` waited out
the process group's timeout, and a different ``lr`` trained replicas that parted with no error.
"""

import pytest
import torch

from _dist import run_ranks


def _built_differently(rank, world, what):
    """Two ranks; rank 1 differs in ``what``. Returns (steps taken, the error's type and text, setup stats)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, loss_fn, make_model

    model = make_model()
    hooked = what not in ("lr without the hook", "nothing without the hook")
    forward = DDP(model) if hooked else model
    kw = dict(lr=1e-2, freeze_step=4)
    cls = OneBitAdam
    if rank == 1:
        if what == "freeze_step":
            kw["freeze_step"] = 6
        elif what == "lr without the hook":
            kw["lr"] = 5e-2
        elif what == "exact_step_dtype":
            kw["exact_step_dtype"] = "bfloat16"
        elif what == "class":
            cls, kw = ZeroOneAdam, dict(lr=1e-2, var_freeze_step=4)
    opt = cls(forward.parameters(), **kw)
    if what == "step counter" and rank == 1:
        opt.schedule["step"] = 3  # as if resumed from a later checkpoint than rank 0's
    if hooked:
        register_zeroone_hook(forward, opt)
    steps, error, per_step = 0, None, 0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step() communicating without a hook says so
        try:
            for x, y in batches(rank, 6):
                opt.zero_grad()
                loss_fn(forward, x, y).backward()
                opt.step()
                steps += 1
                per_step += opt.last_step_stats.collectives
        except Exception as exc:  # noqa: BLE001 - the test looks at the type
            error = (type(exc).__name__, str(exc))
    setup = (opt.comm_stats.setup_collectives, opt.comm_stats.setup_bytes)
    return steps, error, setup, (opt.comm_stats.collectives, per_step)


@pytest.mark.parametrize(
    ("what", "named"),
    [
        ("freeze_step", ["freeze_step: rank 0 has 4, rank 1 has 6"]),
        ("lr without the hook", ["lr (group 0): rank 0 has 0.01, rank 1 has 0.05"]),
        ("exact_step_dtype", ["exact_step_dtype: ranks [1] differ from rank 0"]),
        ("class", ["optimizer class: ranks [1] differ from rank 0"]),
        ("step counter", ["step counter (schedule['step']): rank 0 has 0, rank 1 has 3"]),
    ],
)
def test_ranks_that_built_the_optimizer_differently_both_raise_naming_the_setting(what, named):
    results = run_ranks(_built_differently, 2, what, timeout=120, collective_timeout=30)
    for rank, (steps, error, _, _) in enumerate(results):
        assert steps == 0 and error is not None, (rank, steps, error)
        kind, message = error
        assert kind == "ValueError" or "ValueError" in message, error  # through DDP's backward on hooked ranks
        assert f"(this is rank {rank})" in message
        for text in named:
            assert text in message, message


@pytest.mark.parametrize("what", ["nothing", "nothing without the hook"])
def test_ranks_that_agree_train_and_the_check_is_counted_apart_from_the_training(what):
    results = run_ranks(_built_differently, 2, what, timeout=120)
    for steps, error, setup, (collectives, per_step) in results:
        assert error is None and steps == 6
        assert setup == (1, 48 * 8)  # one all-gather of 48 float64 to the one other rank, once
        assert collectives == per_step > 0  # the training's count: its steps' collectives, nothing else


def test_one_process_checks_nothing_and_sends_nothing():
    from hf_zeroone import OneBitAdam

    p = torch.nn.Parameter(torch.ones(3))
    opt = OneBitAdam([p], lr=1e-2, freeze_step=2)
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
    assert opt.comm_stats.setup_collectives == 0 and opt.comm_stats.setup_bytes == 0


def _loaded_apart(rank, world):
    """Both ranks load a checkpoint, rank 1 one of a later step: the next step compares again."""
    import warnings

    from hf_zeroone import OneBitAdam

    from _workloads import batches, loss_fn, make_model

    model = make_model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=4)
    warnings.simplefilter("ignore")  # step() communicating without a hook says so
    data = batches(rank, 6)
    for x, y in data[:2]:
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    state = opt.state_dict()
    if rank == 1:
        state["hf_zeroone"]["schedule"]["step"] = 3  # a later checkpoint than rank 0's
    opt.load_state_dict(state)
    opt.zero_grad()
    loss_fn(model, *data[2]).backward()
    try:
        opt.step()
    except ValueError as exc:
        return str(exc), opt.comm_stats.setup_collectives
    return None, opt.comm_stats.setup_collectives


def test_a_load_on_every_rank_is_compared_at_the_next_step():
    for message, setups in run_ranks(_loaded_apart, 2, timeout=120, collective_timeout=30):
        assert message is not None and "step counter (schedule['step']): rank 0 has 2, rank 1 has 3" in message
        assert setups == 2  # once at the first step, once after the load
