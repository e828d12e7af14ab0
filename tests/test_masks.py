"""Momentum masks follow the data: rows first seen after compression started begin to train."""

import pytest
import torch

from _dist import run_ranks

LATE, UNUSED = 7, [0, 4, 5, 6, 8, 9]


def _optimizer(name, params):
    from hf_zeroone import OneBitAdam, ZeroOneAdam

    if name == "onebit":
        return OneBitAdam(params, lr=1e-2, freeze_step=3, weight_decay=0.0)  # decay would move unused rows (as AdamW's)
    return ZeroOneAdam(params, lr=1e-2, var_freeze_step=3, var_update_scaler=1, local_step_scaler=2, weight_decay=0.0)


def _tokens(step, rank=0):
    """Tokens 1-3 from the start; token 7 from step 6 on (on one rank only, if several)."""
    late = step >= 6 and rank == 0
    return torch.tensor([1, 2, 3, LATE] if late else [1, 2, 3])


def _train_embedding(rank, world, name, use_ddp):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone.ddp_hook import register_zeroone_hook

    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    target = torch.linspace(-1, 1, 4)
    net = emb
    if use_ddp:
        net = DDP(emb)
    opt = _optimizer(name, net.parameters())
    if use_ddp:
        register_zeroone_hook(net, opt)
    start = emb.weight.detach().clone()
    history, kinds = [], []
    for step in range(30):
        kinds.append(opt.next_step_kind().value)
        opt.zero_grad()
        loss = ((net(_tokens(step, rank)) - target) ** 2).sum()
        loss.backward()
        opt.step()
        history.append(emb.weight.detach().clone())
    return {"start": start, "history": torch.stack(history), "kinds": kinds}


def _check(run, target_row_moves=True):
    start, history = run["start"], run["history"]
    assert torch.isfinite(history).all()
    assert torch.equal(history[:, UNUSED], start[UNUSED].expand(len(history), -1, -1))  # no drift at all
    assert torch.equal(history[5, LATE], start[LATE])  # not seen before step 6
    late = history[-1, LATE]
    target = torch.linspace(-1, 1, 4)
    assert ((late - target).abs() < (start[LATE] - target).abs() - 0.01).all(), (start[LATE], late)
    steps = (history[1:, LATE] - history[:-1, LATE]).abs()
    assert steps.max() < 0.2  # an Adam-sized step (lr 1e-2 ...), not m / eps


@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_row_first_seen_after_compression_starts_trains_and_unused_rows_stay(name):
    _check(_train_embedding(0, 1, name, use_ddp=False))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_row_seen_on_one_rank_only_trains_on_every_rank(name):
    res = run_ranks(_train_embedding, 2, name, True, timeout=120)
    synced = [i for i, kind in enumerate(res[0]["kinds"]) if kind != "local"]
    assert synced[-1] > 20
    assert torch.equal(res[0]["history"][synced], res[1]["history"][synced])  # identical after every sync
    _check(res[0])


def test_user_masked_elements_stay_masked_when_their_row_is_released():
    from hf_zeroone import OneBitAdam

    w = torch.nn.Parameter(torch.ones(3, 2))
    user = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    opt = OneBitAdam([{"params": [w], "exp_avg_mask": user}], lr=1e-2, freeze_step=2, weight_decay=0.0)
    for step in range(6):
        w.grad = torch.tensor(
            [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]] if step < 3 else [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
        )
        opt.step()
    assert opt.state[w]["momentum_mask"].tolist() == [[True, True], [False, False], [True, False]]
    assert w[2, 1].item() == 1.0 and w[2, 0].item() < 1.0 and torch.equal(w[1], torch.ones(2))
