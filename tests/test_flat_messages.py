"""A bucket's 1-bit message is computed on flat tensors: its arithmetic does not grow with the tensors.

The message chain (clipping to the variance, the momentum, the units of the update, the
denominators they divide by) runs once on the bucket's flat vectors
(:mod:`hf_zeroone.optim._onebit_messages`). Run as multi-tensor calls over per-parameter lists it
costs one operation per tensor and step of the chain, host work on every device. The test counts
the arithmetic operations nested in ``Messages.write`` during one 1-bit momentum step of DDP with
the hook on 2 gloo ranks, for two model sizes: what each added tensor adds.
"""

from __future__ import annotations

import torch

from tests._dist import run_ranks

#: element-wise maths; copies and views (the flat gathers, one per tensor) are not counted
_MATHS = {
    "aten::sqrt", "aten::sqrt_", "aten::div", "aten::div_", "aten::add", "aten::add_", "aten::mul", "aten::mul_",
    "aten::minimum", "aten::maximum", "aten::maximum_", "aten::neg_", "aten::lerp", "aten::lerp_",
    "aten::clamp_max", "aten::clamp_min_", "aten::where",
}  # fmt: skip


def _write_maths(rank: int, world: int, n: int, groups: int) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, register_zeroone_hook
    from hf_zeroone.optim._messages import Messages

    write = Messages.write

    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with torch.profiler.record_function("write"):
            return write(*args, **kwargs)

    Messages.write = recorded
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(n)]
    ddp = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=1024)
    weights = [layer.weight for layer in layers]
    biases = [layer.bias for layer in layers]
    if groups == 1:
        param_groups = [{"params": weights + biases}]
    else:  # a transformer's decay and no-decay groups, interleaved in the bucket
        param_groups = [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}]
    opt = OneBitAdam(param_groups, lr=1e-3, freeze_step=3)
    register_zeroone_hook(ddp, opt)
    gen = torch.Generator().manual_seed(rank)
    for step in range(8):
        x = torch.randn(4, 8, generator=gen)
        if step < 7:
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            ddp(x).square().mean().backward()
        assert opt.next_step_kind().value == "onebit_momentum"
    count = 0
    for event in p.events():
        parent = event.cpu_parent
        while parent is not None and parent.name != "write":
            parent = parent.cpu_parent
        count += parent is not None and event.name in _MATHS
    return count


def test_the_momentum_message_is_maths_on_the_flat_bucket():
    small, large = 4, 20
    for groups in (1, 2):
        counts = {n: run_ranks(_write_maths, 2, n, groups)[0] for n in (small, large)}
        assert counts[small] > 0, counts  # the profiler saw the chain
        per_tensor = (counts[large] - counts[small]) / (2 * (large - small))  # two tensors per layer
        assert per_tensor == 0, (groups, counts)


def test_groups_with_their_own_betas_in_one_bucket_each_get_their_own_message():
    """Interleaved groups that differ in ``betas`` and ``eps`` share a bucket: each element's message
    is what its group's alone would be, bit for bit."""
    from hf_zeroone import OneBitAdam
    from hf_zeroone.optim._step_kind import StepKind

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    weights, biases = [model[0].weight, model[2].weight], [model[0].bias, model[2].bias]
    opt = OneBitAdam(
        [{"params": weights}, {"params": biases, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}],
        lr=1e-3, freeze_step=3,
    )  # fmt: skip
    for _ in range(5):
        model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model(torch.randn(8, 6)).square().mean().backward()
    params = list(model.parameters())  # weight, bias, weight, bias: the groups interleave

    def written(ps):
        flat = opt.flat_cache.get(ps)
        message = flat.new_message()
        views = flat.views(message)
        opt.messages.write(
            StepKind.ONEBIT_MOMENTUM, ps, [p.grad for p in ps], views, message[: flat.layout.numel], flat.views
        )
        opt.variance_views.release()
        return [v.clone() for v in views]

    together = dict(zip(map(id, params), written(params)))
    for group in (weights, biases):
        for p, alone in zip(group, written(group)):
            assert torch.equal(together[id(p)], alone)


def _hook_and_step_with_two_betas(rank: int, world: int) -> list[bool]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, register_zeroone_hook

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        params = list(model.parameters())[::-1]  # DDP's bucket order, for the step() path too
        groups = [{"params": params[0::2]}, {"params": params[1::2], "betas": (0.8, 0.99), "eps": 1e-6}]
        return model, OneBitAdam(groups, lr=1e-2, freeze_step=3)

    (ma, oa), (mb, ob) = make(), make()
    ddp = DDP(ma, bucket_cap_mb=100)
    register_zeroone_hook(ddp, oa)
    gen = torch.Generator().manual_seed(rank)
    equal = []
    for _ in range(8):
        x = torch.randn(8, 6, generator=gen)
        for model, opt in ((ddp, oa), (mb, ob)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        equal.append(all(torch.equal(a, b) for a, b in zip(ma.parameters(), mb.parameters())))
    assert oa.last_step_kind.value == "onebit_momentum"
    return equal


def test_groups_with_their_own_betas_take_the_same_steps_with_the_hook_and_without():
    assert all(run_ranks(_hook_and_step_with_two_betas, 2)[0])
