"""The NCCL path on 2+ GPUs, against the same runs on gloo ranks on the CPU.

Each rank of an NCCL run owns one GPU (rank r on cuda:r). Checked: results bit-identical across
ranks, close to the CPU run, bytes and collectives counted alike, a NaN on one rank reaches every
rank and spares the error buffers, the replica checksum works on NCCL (and catches a drift),
DDP training through every phase, data-parallel sub-groups (4+ GPUs).
"""

import pytest
import torch

from _dist import run_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs for NCCL; {GPUS} visible here")


def _collectives(rank, world, device):
    import torch

    from hf_zeroone.comm import Communicator
    from hf_zeroone.compression import ChunkLayout

    comm = Communicator()
    g = torch.Generator().manual_seed(21 + rank)
    n = 30_001
    keep = torch.ones(n, dtype=torch.bool)
    keep[10:500] = False
    layout = ChunkLayout.from_mask(n, world, keep, device, segment_starts=[7, 20_000])
    we, se = torch.zeros(layout.padded, device=device), torch.zeros(layout.chunk, device=device)
    outs, errors_kept = [], None
    for t in range(6):
        buf = torch.zeros(layout.padded)
        buf[:n] = torch.randn(n, generator=g)
        if t == 4 and rank == 1:
            buf[77] = float("nan")
        before = (we.clone(), se.clone())
        outs.append(comm.compressed_allreduce(buf.to(device), we, se, layout).cpu())
        if t == 4:
            errors_kept = torch.equal(we, before[0]) and torch.equal(se, before[1])
    mean = comm.allreduce_mean(torch.full((5,), float(rank), device=device)).cpu()
    comm.assert_identical([outs[-1].to(device)], "results")
    drift = None
    try:
        comm.assert_identical([torch.full((3,), float(rank), device=device)], "values")
    except RuntimeError as exc:
        drift = str(exc)
    stats = comm.stats.as_dict()
    comm.close()
    return {"outs": torch.stack(outs), "mean": mean, "errors_kept": errors_kept, "drift": drift, "stats": stats}


def test_compressed_allreduce_on_nccl_matches_gloo_on_the_cpu():
    nccl = run_ranks(_collectives, 2, "cuda", backend="nccl", timeout=300)
    gloo = run_ranks(_collectives, 2, "cpu", timeout=300)
    assert torch.equal(nccl[0]["outs"].view(torch.int32), nccl[1]["outs"].view(torch.int32))  # the same bits
    assert torch.isnan(nccl[0]["outs"][4]).all() and all(r["errors_kept"] for r in nccl)
    finite = [0, 1, 2, 3, 5]
    assert torch.allclose(nccl[0]["outs"][finite], gloo[0]["outs"][finite], rtol=1e-4, atol=1e-6)
    assert nccl[0]["mean"].tolist() == [0.5] * 5
    assert nccl[0]["stats"] == gloo[0]["stats"]  # the same bytes and collectives counted
    for r in nccl:
        assert r["drift"] is not None and "differ between ranks" in r["drift"]


def _train(rank, world, device, name):
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
        opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=5, check_replicas_every=1)
    else:
        opt = ZeroOneAdam(
            ddp.parameters(), lr=1e-2, var_freeze_step=10, var_update_scaler=1, local_step_scaler=2,
            local_step_clipper=4, check_replicas_every=1,
        )  # fmt: skip
    register_zeroone_hook(ddp, opt)
    losses = []
    for x, y in batches(rank, 30):
        opt.zero_grad()
        loss = loss_fn(ddp, x.to(device), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"params": flat_params(model).cpu(), "losses": losses, "bytes": opt.comm_stats.bytes_sent}


@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_ddp_training_on_nccl_keeps_replicas_identical_and_tracks_the_cpu_run(name):
    nccl = run_ranks(_train, 2, "cuda", name, backend="nccl", timeout=400)
    gloo = run_ranks(_train, 2, "cpu", name, timeout=400)
    assert torch.equal(nccl[0]["params"], nccl[1]["params"])  # check_replicas_every=1 also ran each pass
    assert nccl[0]["bytes"] == gloo[0]["bytes"]  # same buckets, same layouts: the same bytes counted
    cuda_losses, cpu_losses = torch.tensor(nccl[0]["losses"]), torch.tensor(gloo[0]["losses"])
    # exact warm-up: float32 rounding apart; after it, 1-bit signs near zero may differ: close on average
    assert torch.allclose(cuda_losses[:4], cpu_losses[:4], rtol=1e-4), (cuda_losses, cpu_losses)
    assert abs(cuda_losses[-10:].mean() / cpu_losses[-10:].mean() - 1) < 0.02, (cuda_losses, cpu_losses)


def _subgroups(rank, world):
    import torch
    import torch.distributed as dist

    from hf_zeroone.comm import Communicator
    from hf_zeroone.compression import ChunkLayout

    groups = [dist.new_group(list(range(k, k + 2))) for k in range(0, world, 2)]
    comm = Communicator(groups[rank // 2])  # each DP group alone
    layout = ChunkLayout.from_mask(1000, 2, None, "cuda")
    buf = torch.arange(layout.padded, dtype=torch.float32, device="cuda") * (1 + rank // 2) + rank % 2
    res = comm.compressed_allreduce(buf, torch.zeros_like(buf), torch.zeros(layout.chunk, device="cuda"), layout)
    comm.assert_identical([res], "results")
    comm.close()
    return res.cpu()


@pytest.mark.skipif(GPUS < 4, reason=f"needs 4 CUDA GPUs for two data-parallel groups; {GPUS} visible here")
def test_data_parallel_subgroups_on_nccl():
    res = run_ranks(_subgroups, 4, backend="nccl", timeout=300)
    assert torch.equal(res[0], res[1]) and torch.equal(res[2], res[3]) and not torch.equal(res[0], res[2])
