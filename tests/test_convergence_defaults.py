"""Reaching AdamW's result with default settings.

Every optimizer here gets only what a user sets: the learning rate and its schedule, the run
length and ``freeze_step`` / ``var_freeze_step``, and no weight decay (the same for all, as in
the runs these figures come from; the default is AdamW's 1e-2 since 430932b). Everything else is
the default, including ``follow_gradient_scale=True``, without which the least-squares runs end
3-5x above AdamW.
"""

import pytest
import torch

from _dist import run_ranks

LSQ_STEPS, LSQ_FREEZE = 640, 200


def _lsq_batch(gen: torch.Generator, n: int, w_true: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, w_true.shape[1], generator=gen)
    return x, x @ w_true.T + 0.1 * torch.randn(n, w_true.shape[0], generator=gen)


def _lsq(name: str, rank: int = 0, world: int = 1, batch: int = 48, **options) -> float:
    """Least squares (weights of std 1): the loss, and the gradient's scale, fall 100x after the freeze."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam, register_zeroone_hook

    w_true = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 32)
    net = DDP(model) if world > 1 else model
    kw = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.0}
    if name == "onebit":
        opt = OneBitAdam(net.parameters(), freeze_step=LSQ_FREEZE, **kw, **options)
    elif name == "zeroone":
        opt = ZeroOneAdam(net.parameters(), var_freeze_step=LSQ_FREEZE, **kw, **options)
    else:
        opt = torch.optim.AdamW(net.parameters(), **kw)
    if world > 1 and name != "adamw":
        register_zeroone_hook(net, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (LSQ_STEPS - s) / LSQ_STEPS)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(LSQ_STEPS):
        x, y = _lsq_batch(gen, batch, w_true)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        sched.step()
    x, y = _lsq_batch(torch.Generator().manual_seed(999), 4096, w_true)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_frozen_variance_follows_the_gradient_scale_in_one_process(name):
    """No compression at all: only the frozen variance differs from AdamW (2.9x / 5x without the option)."""
    adamw, mine = _lsq("adamw"), _lsq(name)
    assert mine < 1.25 * adamw, (name, mine, adamw)


def _lsq_ranks(rank, world):
    out = {name: _lsq(name, rank, world, batch=16) for name in ("adamw", "onebit", "zeroone")}
    for name in ("onebit", "zeroone"):  # exact steps in full precision and in bf16, not the default float8
        out[name + "_fp32"] = _lsq(name, rank, world, batch=16, exact_step_dtype="float32")
        out[name + "_bf16"] = _lsq(name, rank, world, batch=16, exact_step_dtype="bfloat16")
    out["zeroone_gap1"] = _lsq("zeroone", rank, world, batch=16, local_step_clipper=1)
    return out


@pytest.fixture(scope="module")
def lsq_two_ranks():
    return run_ranks(_lsq_ranks, 2, timeout=240)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_frozen_variance_follows_the_gradient_scale_on_two_ranks_through_the_hook(lsq_two_ranks, name):
    """The scale is the mean over ranks of the local squared norms, before and after the freeze alike.

    Measured (seeds 0-2 of this run): 1-bit Adam 1.01-1.02x AdamW's loss, 0/1 Adam 1.03-1.06x. 0/1
    Adam ended at 1.36x while its syncs were sent in units that followed the gradient scale
    (``_local_phase.per_lr_units``).
    """
    assert lsq_two_ranks[name] < 1.25 * lsq_two_ranks["adamw"], lsq_two_ranks


@pytest.mark.slow
def test_zeroone_syncing_every_step_ends_where_onebit_adam_ends(lsq_two_ranks):
    """A sync at every step is 1-bit Adam's compressed momentum step in other units: the same end.

    Without compression the two runs are bit-identical. With it, 0/1 Adam's error feedback keeps
    its sums only if the sync's units stay put while ``v`` is frozen: in units that followed
    ``follow_gradient_scale``'s factor it ended 1.20x AdamW's loss where 1-bit Adam ended 1.02x
    (seeds 0-2: 1.19-1.20x against 1.01-1.02x); now within 0.1% of 1-bit Adam on each seed (the
    bound allows 5%, a quarter of the defect).
    """
    assert abs(lsq_two_ranks["zeroone_gap1"] / lsq_two_ranks["onebit"] - 1) < 0.05, lsq_two_ranks


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_bf16_exact_steps_end_where_full_precision_ones_do(lsq_two_ranks, name):
    """exact_step_dtype="bfloat16" (the default before float8) halves the exact steps' bytes without moving the result.

    Same run, exact steps (the first 200 of 640) averaged through the hook in bf16 and in fp32:
    the final loss is within 2% of the fp32 run's. Measured: 1-bit Adam +0.09%, 0/1 Adam -0.27%.
    """
    bf16, fp32 = lsq_two_ranks[name + "_bf16"], lsq_two_ranks[name + "_fp32"]
    assert abs(bf16 / fp32 - 1) < 0.02, lsq_two_ranks


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_float8_exact_steps_end_where_full_precision_ones_do(lsq_two_ranks, name):
    """The default exact_step_dtype (float8, a byte per element, a quarter of fp32's) ends where fp32 exact steps end.

    The same run as above with its exact steps sent as float8 messages, the default: within 2% of
    the fp32 run's final loss.
    """
    float8, fp32 = lsq_two_ranks[name], lsq_two_ranks[name + "_fp32"]
    assert abs(float8 / fp32 - 1) < 0.02, lsq_two_ranks


def _hook_and_step_paths(rank, world, name):
    """The same run through the DDP hook and through ``step()``: parameters after every step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam, register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    def make(params):
        params = list(params)[::-1]  # DDP's single bucket holds them in reverse order
        kw = {"lr": 1e-2, "follow_gradient_scale": True}
        if name == "onebit":
            return OneBitAdam(params, freeze_step=4, **kw)
        return ZeroOneAdam(params, var_freeze_step=8, local_step_scaler=2, local_step_clipper=4, **kw)

    ma, mb = make_model(), make_model()
    ddp = DDP(ma, bucket_cap_mb=100)
    oa, ob = make(ddp.parameters()), make(mb.parameters())
    register_zeroone_hook(ddp, oa)
    equal = []
    for x, y in batches(rank, 24):
        for model, opt in ((ddp, oa), (mb, ob)):
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
        equal.append(bool(torch.equal(flat_params(ma), flat_params(mb))))
    return equal, oa.state[next(iter(ma.parameters()))]["grad_scale"].item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_following_the_gradient_scale_keeps_the_hook_and_step_paths_bit_identical(name):
    equal, scale = run_ranks(_hook_and_step_paths, 2, name, timeout=200)[0]
    assert all(equal), equal
    assert scale > 0 and scale != 1.0  # the scale was sampled, and moved


# ---------------------------------------------------------------- a small GPT-2, default settings
GPT_STEPS, GPT_WARMUP, GPT_FREEZE, GPT_SEQ = 400, 40, 100, 32


def _docstring_bytes() -> torch.Tensor:
    """Real English text that ships offline: docstrings of a few stdlib modules, as bytes."""
    import argparse
    import collections
    import email
    import http.client
    import inspect
    import json
    import logging
    import textwrap
    import unittest

    docs = []
    for module in (json, collections, argparse, textwrap, email, http.client, unittest, logging, inspect):
        for obj in [module] + [getattr(module, a) for a in dir(module) if not a.startswith("_")][:200]:
            doc = inspect.getdoc(obj)
            if doc:
                docs.append(doc)
    return torch.tensor(list("\n".join(docs).encode()), dtype=torch.long)


def _small_gpt(name: str, rank: int, world: int) -> dict:
    """A byte-level GPT-2 (2 layers, width 64): what a user sets is lr, its schedule and the freeze."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_zeroone import OneBitAdam, ZeroOneAdam, register_zeroone_hook

    data = _docstring_bytes()
    val, train = data[: len(data) // 10], data[len(data) // 10 :]
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=GPT_SEQ, n_embd=64, n_layer=2, n_head=2)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    net = DDP(model) if world > 1 else model
    if name == "zeroone":
        opt = ZeroOneAdam(net.parameters(), lr=1e-3, var_freeze_step=GPT_FREEZE)
    elif name == "onebit":
        opt = OneBitAdam(net.parameters(), lr=1e-3, freeze_step=GPT_WARMUP)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    if world > 1 and name != "adamw":
        register_zeroone_hook(net, opt)
    decay = GPT_STEPS - GPT_WARMUP
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / GPT_WARMUP, (GPT_STEPS - s) / decay))
    gen = torch.Generator().manual_seed(rank)
    largest_move = 0.0  # the largest change of one element in one step, in units of the learning rate
    for _ in range(GPT_STEPS):
        x = torch.stack([train[i : i + GPT_SEQ] for i in torch.randint(0, len(train) - GPT_SEQ, (8,), generator=gen)])
        opt.zero_grad()
        net(input_ids=x, labels=x).loss.backward()
        lr = opt.param_groups[0]["lr"]
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        sched.step()
        moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
        largest_move = max(largest_move, moved / lr)
    x = torch.stack([val[i : i + GPT_SEQ] for i in range(0, len(val) - GPT_SEQ, GPT_SEQ)][:256])
    with torch.no_grad():
        return {"loss": float(model(input_ids=x, labels=x).loss), "largest_move": largest_move}


def _small_gpt_ranks(rank, world):
    return {name: _small_gpt(name, rank, world) for name in ("adamw", "onebit", "zeroone")}


@pytest.mark.slow
def test_default_settings_reach_adamw_on_a_small_gpt2_without_stalling():
    """Issue 11's stall: 0/1 Adam's defaults ended 25.7% above AdamW on this run.

    The cause: an element with a tiny variance (an attention key bias, whose exact gradient is
    zero) got 1-bit noise at its segment's scale, divided by ``eps``, and moved by up to 274,000
    learning rates in one step; 0/1 Adam's local phase then blew up. Such elements are now
    compressed in units of their update (``compression_weight``).
    """
    runs = run_ranks(_small_gpt_ranks, 2, timeout=400)[0]
    adamw = runs["adamw"]["loss"]
    for name in ("onebit", "zeroone"):
        assert runs[name]["loss"] < 1.02 * adamw, runs  # before: 1-bit -1.3%, 0/1 +25.7%
    assert runs["adamw"]["largest_move"] < 5, runs  # Adam's own steps: about 2.6 lr at most
    assert runs["onebit"]["largest_move"] < 1000, runs  # before: 274,000 lr; now about 190
    # A sync moves a replica by the whole interval's disagreement, and late in the run (lr near 0)
    # the frozen variance makes some local steps large in units of lr: about 600 lr; before, 79,000.
    assert runs["zeroone"]["largest_move"] < 5000, runs
