"""Optimizers and the DDP hook on CUDA against the same run on the CPU.

Same data, same initial weights, TF32 off: the trajectories agree to float32 rounding (CUDA
kernels sum in another order, so not bit for bit).
"""

import pytest
import torch

from _dist import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible here")


def _ddp_run(rank, world, device, name):
    """World size 1, real DDP with the hook registered: NCCL on CUDA, or gloo on the CPU."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.ddp_hook import register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = make_model(embedding_rows=3).to(device)
    ddp = DDP(model, bucket_cap_mb=0.004)
    if name == "onebit":
        opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=4)
    else:
        opt = ZeroOneAdam(
            ddp.parameters(), lr=1e-2, var_freeze_step=8, var_update_scaler=1, local_step_scaler=2,
            local_step_clipper=4,
        )  # fmt: skip
    register_zeroone_hook(ddp, opt)
    trajectory, kinds = [], []
    for x, y in batches(rank, 20):
        opt.zero_grad()
        loss_fn(ddp, x.to(device), y.to(device)).backward()
        opt.step()
        trajectory.append(flat_params(model).cpu())
        kinds.append(opt.last_step_kind.value)
    return torch.stack(trajectory), kinds


@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_one_rank_ddp_run_on_cuda_equals_the_cpu_run(name):
    cuda, kinds = run_ranks(_ddp_run, 1, "cuda", name, backend="nccl", timeout=300)[0]
    cpu, cpu_kinds = run_ranks(_ddp_run, 1, "cpu", name, timeout=300)[0]
    assert kinds == cpu_kinds and len(set(kinds)) >= 2
    assert torch.allclose(cuda, cpu, rtol=1e-4, atol=1e-6), (cuda - cpu).abs().max()


@pytest.mark.filterwarnings("ignore:.*communicates in step\\(\\) because no hf_zeroone DDP hook")
@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_the_compressed_step_path_on_cuda_equals_the_cpu(name):
    """Two simulated ranks (loopback): the worker thread, its stream and the 1-bit maths in step()."""
    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.comm import Communicator

    g = torch.Generator().manual_seed(11)
    shapes = [(64, 16), (64,), (33, 64), (1, 33)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) * 0.1 for s in shapes] for _ in range(24)]
    runs = {}
    for device in ("cpu", "cuda"):
        params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
        comm = Communicator._loopback(2)
        if name == "onebit":
            opt = OneBitAdam(params, lr=1e-2, freeze_step=4, communicator=comm)
        else:
            opt = ZeroOneAdam(
                params, lr=1e-2, var_freeze_step=8, var_update_scaler=1, local_step_scaler=2,
                local_step_clipper=4, communicator=comm,
            )  # fmt: skip
        side = torch.cuda.Stream() if device == "cuda" else None
        out = []
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.to(device)
            if side is None:
                opt.step()
            else:  # the step on a side stream, ordered after the gradients and before the read below
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    opt.step()
                torch.cuda.current_stream().wait_stream(side)
            out.append(torch.cat([p.detach().reshape(-1).cpu() for p in params]))
        runs[device] = torch.stack(out)
        comm.close()
    assert torch.allclose(runs["cuda"], runs["cpu"], rtol=1e-4, atol=1e-6), (runs["cuda"] - runs["cpu"]).abs().max()
