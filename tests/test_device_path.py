"""The GPU path's logic, checked on the CPU: no host reads, same bits, sub-groups, checksum device.

What needs a GPU (streams, events, CUDA-aware futures, NCCL) is in ``tests/gpu/``.
"""

import threading
from datetime import timedelta

import pytest
import torch

import hf_zeroone._two_stage as comm_module
import hf_zeroone.compression as compression
from hf_zeroone._executor import _backend_object, collective_device
from hf_zeroone.comm import Communicator
from hf_zeroone.compression import ChunkLayout

from _dist import run_ranks

HOST_READS = ("__bool__", "item", "tolist", "__float__", "__int__", "__index__")


class _HostRead(AssertionError):
    pass


@pytest.fixture
def no_host_reads(monkeypatch):
    """While active, reading a tensor's value on the host (what syncs a GPU) raises, on any thread."""
    active = threading.Event()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _original=original, _name=name, **kwargs):
            if active.is_set():
                raise _HostRead(f"host read of a tensor value (Tensor.{_name}) in the hot path")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    monkeypatch.setattr(comm_module, "_HOST_BRANCH_ON_CPU", False)  # the accelerator path, on the CPU
    monkeypatch.setattr(compression, "EXPAND_BELOW", 1 << 62)  # the scales expanded, whatever the segments
    return active


def _rounds(comm, world, rank, seed):
    """Compressed allreduces with masks, segments, a NaN and an inf on one rank, signed zeros."""
    g = torch.Generator().manual_seed(seed + rank)
    out = []
    for n, masked, starts in [(1003, True, [17, 100, 500, 501, 900]), (64, False, []), (5, False, [])]:
        keep = None
        if masked:
            keep = torch.ones(n, dtype=torch.bool)
            keep[100:140] = False
        layout = ChunkLayout.from_mask(n, world, keep, segment_starts=starts)
        we, se = torch.zeros(layout.padded), torch.zeros(layout.chunk)
        for t in range(6):
            buf = torch.zeros(layout.padded)
            buf[:n] = torch.randn(n, generator=g) * (t + 1)
            if t == 2 and rank == world - 1:
                buf[n // 2] = float("nan")
            if t == 3 and rank == 0:
                buf[0] = float("-inf")
            if t == 4:
                buf[:n:3] = -0.0
            res = comm.compressed_allreduce(buf, we, se, layout)
            out += [res.view(torch.int32).clone(), we.view(torch.int32).clone(), se.view(torch.int32).clone()]
    return out


def _both_paths(rank, world):
    import hf_zeroone._two_stage as cm
    import hf_zeroone.compression as compression
    from hf_zeroone.comm import Communicator

    results = []
    for host_branch in (True, False):
        cm._HOST_BRANCH_ON_CPU = host_branch
        compression.EXPAND_BELOW = 1 << 62 if not host_branch else 0  # scales expanded, or by slices
        comm = Communicator()
        results.append(_rounds(comm, world, rank, 40))
        comm.close()
    return results


@pytest.mark.slow
def test_the_accelerator_path_gives_the_same_bits_as_the_host_branch():
    """The where/NaN path the GPU takes (scales expanded per element) equals the CPU's host branch bit for bit."""
    for r, (host, device) in enumerate(run_ranks(_both_paths, 3, timeout=180)):
        assert len(host) == len(device) == 54
        for i, (a, b) in enumerate(zip(host, device)):
            assert torch.equal(a, b), (r, i)
        assert torch.isnan(host[6].view(torch.float32)).all()  # the NaN round: all NaN, on every rank


def test_the_compressed_allreduce_reads_nothing_on_the_host(no_host_reads):
    """The arithmetic and the worker thread's job, on the accelerator path: no tensor value read on the host."""
    comm = Communicator._loopback(4, rank=1)
    layout = ChunkLayout.from_mask(1003, 4, torch.arange(1003) % 7 != 0, segment_starts=[17, 500])
    we, se = torch.zeros(layout.padded), torch.zeros(layout.chunk)
    no_host_reads.set()
    futs = []
    for t in range(3):
        buf = torch.randn(layout.padded)
        if t == 1:
            buf[5] = float("nan")
        futs.append(comm.compressed_allreduce_async(buf, we, se, layout))
        futs.append(comm.allreduce_mean_async(torch.ones(8)))
    values = [f.wait() for f in futs]
    no_host_reads.clear()
    comm.close()
    assert torch.isnan(values[2]).all() and torch.isfinite(values[4]).all()


def test_the_float8_allreduce_reads_nothing_on_the_host(no_host_reads):
    """Encoding, the server's average and decoding, with a NaN round: no tensor value read on the host."""
    comm = Communicator._loopback(4, rank=1)
    no_host_reads.set()
    futs = []
    for t in range(3):
        buf = torch.randn(1003)
        if t == 1:  # (loopback: every chunk of the result is this rank's chunk, so NaN everywhere)
            buf.fill_(float("nan"))
        futs.append(comm.float8_allreduce_async(buf, [17, 483, 503], exact=torch.ones(3)))
    values = [f.wait() for f in futs]
    no_host_reads.clear()
    comm.close()
    assert torch.isnan(values[1]).all() and torch.isfinite(values[2]).all()


class _Bucket:
    """What zeroone_hook uses of a DDP GradBucket: its index, a flat buffer, its parameters, gradient views."""

    def __init__(self, params, index):
        self._params, self._index = list(params), index
        self._buffer = torch.cat([p.grad.reshape(-1) for p in self._params])
        self._grads, offset = [], 0
        for p in self._params:
            self._grads.append(self._buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads


@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_the_hook_reads_nothing_on_the_host(no_host_reads, name):
    """Every step kind the hook handles (exact, 1-bit gradient, 1-bit momentum, local + overflow check)."""
    from hf_zeroone import OneBitAdam, ZeroOneAdam
    from hf_zeroone.ddp_hook import ZeroOneHookState, zeroone_hook

    from _workloads import batches, loss_fn, make_model

    model = make_model(embedding_rows=4)
    comm = Communicator._loopback(2)
    if name == "onebit":
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3, communicator=comm)
    else:
        opt = ZeroOneAdam(
            model.parameters(), lr=1e-2, var_freeze_step=6, var_update_scaler=1, local_step_scaler=2,
            local_step_clipper=4, communicator=comm, exact_warmup_steps=0,
        )  # fmt: skip
    state = ZeroOneHookState(opt, overflow_check_on_local_steps=True)
    params = [p for p in model.parameters() if p.requires_grad]
    seen, checked = set(), set()
    for x, y in batches(0, 16):
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        kind = opt.next_step_kind()
        if kind in seen:  # caches (layouts, masks) are built the first time a kind comes
            no_host_reads.set()
            checked.add(kind.value)
        seen.add(kind)
        buckets = [_Bucket(params[:3], 0), _Bucket(params[3:], 1)]
        results = [zeroone_hook(state, b).wait() for b in buckets]
        no_host_reads.clear()
        for b, res in zip(buckets, results):
            for p, g in zip(b.parameters(), res.split([p.numel() for p in b.parameters()])):
                p.grad = g.view_as(p).clone()
        opt.step()
    comm.close()
    expected = {"exact", "onebit_momentum"} if name == "onebit" else {"exact", "onebit_gradient", "local"}
    assert expected <= checked, checked


def test_the_worker_thread_and_inline_runs_agree():
    layout = ChunkLayout.from_mask(5000, 3, segment_starts=[100, 2500])
    results = []
    for threaded in (True, False):
        comm = Communicator._loopback(3, rank=2, threaded=threaded)
        we, se = torch.zeros(layout.padded), torch.zeros(layout.chunk)
        g = torch.Generator().manual_seed(0)
        bufs = [torch.randn(layout.padded, generator=g) for _ in range(4)]
        futs = [comm.compressed_allreduce_async(b, we, se, layout) for b in bufs]
        results.append([f.wait() for f in futs] + [we, se])
        comm.close()
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_checksums_are_gathered_where_the_backend_takes_them(monkeypatch):
    cpu = torch.device("cpu")
    assert collective_device("gloo", cpu) == cpu
    assert collective_device("gloo", torch.device("cuda", 1)) == cpu  # gloo: CPU tensors
    assert collective_device("cpu:gloo,cuda:nccl", torch.device("cuda", 0)) == cpu
    assert collective_device("nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)  # NCCL: CUDA only
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device("nccl", cpu) == torch.device("cuda", 3)  # CPU parameters, NCCL group
    assert collective_device("xccl", torch.device("xpu", 0)) == torch.device("xpu", 0)


def test_bit_checksum_is_the_integer_sum_of_the_bits_on_any_target_device():
    from hf_zeroone.comm import bit_checksum

    ts = [torch.randn(1000), torch.randn(7, dtype=torch.float64), torch.randn(33).half()]
    ts.append(torch.arange(5, dtype=torch.uint8))
    expected = torch.zeros(2, dtype=torch.int64)
    for i, t in enumerate(ts):
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        s = t.view(bits).to(torch.int64).sum()
        expected += torch.stack([s, s * (i + 1)])
    assert torch.equal(bit_checksum(ts), expected)
    assert torch.equal(bit_checksum(ts, device="cpu"), expected)
    assert torch.equal(bit_checksum([]), torch.zeros(2, dtype=torch.int64))


class _FakeNCCL:
    """Stands in for ``ProcessGroupNCCL`` (absent from CPU builds): records how it was built."""

    built: list = []

    class Options:
        pass

    def __init__(self, store, rank, size, options):
        _FakeNCCL.built.append((type(store).__name__, rank, size, options._timeout, options.is_high_priority_stream))


def test_the_nccl_group_is_a_backend_object_on_the_given_store(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    _FakeNCCL.built = []
    store = dist.HashStore()
    _backend_object("nccl", store, 1, 2, timedelta(seconds=7), "hf_zeroone/x")
    assert _FakeNCCL.built == [("HashStore", 1, 2, timedelta(seconds=7), False)]


def _subgroups(rank, world):
    """4 ranks as 2 (TP) x 2 (DP): each DP group builds its communicator, alone."""
    import torch
    import torch.distributed as dist

    import hf_zeroone._executor as ex
    from hf_zeroone.comm import Communicator
    from hf_zeroone.compression import ChunkLayout

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank calls new_group for each
    mine = groups[rank // 2]
    comm = Communicator(mine)  # only the members of `mine`: no world-wide call
    layout = ChunkLayout.from_mask(100, 2)
    buf = torch.zeros(layout.padded)
    buf[:100] = torch.arange(100.0) * (1 + rank // 2) + rank % 2
    res = comm.compressed_allreduce(buf, torch.zeros(layout.padded), torch.zeros(layout.chunk), layout)
    comm.assert_identical([res], "results")
    mean = comm.allreduce_mean(torch.full((3,), float(rank)))
    comm.close()

    # The NCCL branch, with a stand-in for ProcessGroupNCCL: only the group's own ranks build it,
    # each on a store prefix naming the group.
    built = []

    class FakeNCCL(_FakeNCCL):
        def __init__(self, store, rank, size, options):
            built.append((rank, size))

    dist.ProcessGroupNCCL = FakeNCCL
    real_get_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        coll = ex._dedicated_collectives(mine, None)
    finally:
        dist.get_backend = real_get_backend
    return {"result": res, "mean": mean, "nccl": (coll.raw, coll.backend, built)}


@pytest.mark.slow
def test_data_parallel_subgroups_build_their_own_groups():
    res = run_ranks(_subgroups, 4, timeout=180)
    assert torch.equal(res[0]["result"], res[1]["result"]) and torch.equal(res[2]["result"], res[3]["result"])
    assert not torch.equal(res[0]["result"], res[2]["result"])
    assert res[0]["mean"].tolist() == [0.5] * 3 and res[3]["mean"].tolist() == [2.5] * 3
    for r in range(4):
        assert res[r]["nccl"] == (True, "nccl", [(r % 2, 2)])
