"""A compressed step keeps its per-tensor numbers as vectors: no 0-dim tensor per parameter and back.

Norm-proxy factors, the norms handed on, clipping fractions and the samples of
``follow_gradient_scale`` are computed as one vector per bucket. Unbound into a 0-dim tensor per
parameter (``unbind``: a ``select`` each) and stacked again (``stack``: an ``unsqueeze`` each),
every hand-over costs host work per tensor, on every device. The test counts those two
operations on vectors and 0-dim tensors (views of larger pieces are not per-tensor numbers),
nested ones included, in one 1-bit momentum step of DDP with the hook on 2 gloo ranks, for two
model sizes: what each added tensor adds.
"""

from __future__ import annotations

import torch

from tests._dist import run_ranks

#: 0-dim selects and unsqueezes per added tensor, at most (13.75 when these numbers went through a
#: 0-dim tensor per parameter): the stacks of the multi-tensor norms that remain (the local
#: gradients' in the hook, the results' there, in step() and in its finiteness check)
_PER_TENSOR = 4.0


def _momentum_step_views(rank: int, world: int, n: int) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, register_zeroone_hook

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8, bias=False) for _ in range(n)]
    for layer in layers:
        torch.nn.init.orthogonal_(layer.weight)
    ddp = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=1024)
    opt = OneBitAdam(ddp.parameters(), lr=1e-3, freeze_step=3)
    register_zeroone_hook(ddp, opt)
    gen = torch.Generator().manual_seed(rank)
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    for step in range(8):
        x = torch.randn(4, 8, generator=gen)
        if step < 7:
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            continue
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config, record_shapes=True
        ) as p:
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.last_step_kind.value == "onebit_momentum"
    # a select of a vector's element, an unsqueeze of a 0-dim tensor (views of larger pieces do not count)
    dims = {"aten::select": 1, "aten::unsqueeze": 0}
    return sum(e.name in dims and len(e.input_shapes[0]) == dims[e.name] for e in p.events())


def test_a_momentum_step_hands_per_tensor_numbers_on_as_vectors():
    small, large = 8, 40
    counts = {n: run_ranks(_momentum_step_views, 2, n)[0] for n in (small, large)}
    per_tensor = (counts[large] - counts[small]) / (large - small)
    assert per_tensor <= _PER_TENSOR, counts
