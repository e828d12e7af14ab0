"""The compressed allreduce on 2, 3 and 4 gloo ranks."""

import math

import pytest
import torch

from hf_zeroone.comm import CommStats, Communicator, fp32_allreduce_bytes
from hf_zeroone.compression import ChunkLayout

from _dist import run_ranks

SIZES = [1, 13, 1001, 20001]


def _comm_checks(rank, world, sizes):
    import torch

    from hf_zeroone.comm import Communicator
    from hf_zeroone.compression import ChunkLayout

    comm = Communicator()
    out = {"rank": rank}
    g = torch.Generator().manual_seed(1234 + rank)

    # Repeated rounds on constant inputs: the running mean of the outputs converges to the mean.
    for n in sizes:
        x = torch.randn(n, generator=g)
        layout = ChunkLayout.from_mask(n, world)
        we, se = torch.zeros(layout.padded), torch.zeros(layout.chunk)
        before = comm.stats.copy()
        outputs = []
        for _ in range(200):
            buf = torch.zeros(layout.padded)
            buf[:n] = x
            outputs.append(comm.compressed_allreduce(buf, we, se, layout))
        out[f"x{n}"] = x
        out[f"outputs{n}"] = torch.stack(outputs)
        out[f"stats{n}"] = (comm.stats - before).as_dict()

    # Masked elements (and several segments per chunk): exactly zero out, no error kept there.
    n = 40
    keep = torch.ones(n, dtype=torch.bool)
    keep[5:15] = False
    layout = ChunkLayout.from_mask(n, world, keep, segment_starts=[5, 17, 30])
    we, se = torch.zeros(layout.padded), torch.zeros(layout.chunk)
    for _ in range(5):
        buf = torch.zeros(layout.padded)
        buf[:n] = torch.randn(n, generator=g)
        res = comm.compressed_allreduce(buf, we, se, layout)
    out["masked_result"] = res
    out["masked_we"] = we.clone()
    out["masked_se"] = se.clone()

    # Reference check: segments, a caller mask and several rounds of error feedback, against a
    # single-process re-computation of the algorithm in the test (see _reference_rounds).
    n = 1003
    keep = torch.ones(n, dtype=torch.bool)
    keep[100:140] = False
    layout = ChunkLayout.from_mask(n, world, keep, segment_starts=[17, 100, 500, 501, 900])
    we, se = torch.zeros(layout.padded), torch.zeros(layout.chunk)
    ref_inputs, ref_outputs = [], []
    for t in range(6):
        x = torch.randn(n, generator=g) * (1 + t) * torch.linspace(0.01, 3, n)
        ref_inputs.append(x)
        buf = torch.zeros(layout.padded)
        buf[:n] = x
        ref_outputs.append(comm.compressed_allreduce(buf, we, se, layout))
    out["ref_inputs"] = torch.stack(ref_inputs)
    out["ref_outputs"] = torch.stack(ref_outputs)
    out["ref_we"], out["ref_se"] = we.clone(), se.clone()

    # Non-finite input on rank 1 only: NaN everywhere, error buffers untouched, then recovery.
    n = 64
    layout = ChunkLayout.from_mask(n, world)
    we, se = torch.zeros(layout.padded), torch.zeros(layout.chunk)
    buf = torch.zeros(layout.padded)
    buf[:n] = torch.randn(n, generator=g)
    comm.compressed_allreduce(buf, we, se, layout)
    we_before, se_before = we.clone(), se.clone()
    buf = torch.zeros(layout.padded)
    buf[:n] = torch.randn(n, generator=g)
    if rank == 1:
        buf[3] = float("inf")
    bad = comm.compressed_allreduce(buf, we, se, layout)
    out["nonfinite_result"] = bad
    out["nonfinite_errors_unchanged"] = torch.equal(we, we_before) and torch.equal(se, se_before)
    buf = torch.zeros(layout.padded)
    buf[:n] = torch.randn(n, generator=g)
    out["after_nonfinite"] = comm.compressed_allreduce(buf, we, se, layout)

    # Several "buckets" in flight at once (as DDP issues them), then an exact allreduce.
    futs = []
    for n in [100, 7, 3000, 64]:
        layout = ChunkLayout.from_mask(n, world)
        buf = torch.zeros(layout.padded)
        buf[:n] = torch.randn(n, generator=g)
        futs.append(comm.compressed_allreduce_async(buf, torch.zeros(layout.padded), torch.zeros(layout.chunk), layout))
    exact = comm.allreduce_mean_async(torch.full((10,), float(rank)))
    out["inflight"] = [f.wait() for f in futs]
    out["exact_mean"] = exact.wait()

    # An exact allreduce with a lane of float32 values beside tensors of each dtype.
    lanes = {}
    cases = ((torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True))
    for dtype, in_bf16 in cases:
        before = comm.stats.copy()
        lane = torch.tensor([1.0 + rank, 1e-3 * (rank + 1), 3.14159 + rank])
        tensor = torch.full((8,), float(rank + 1), dtype=dtype)
        comm.allreduce_mean(tensor, lane, lane_in_bf16=in_bf16)
        lanes[f"{dtype} {in_bf16}"] = (tensor.float(), lane.clone(), (comm.stats - before).as_dict())
    out["lanes"] = lanes

    # Empty input: nothing sent.
    before = comm.stats.copy()
    layout = ChunkLayout.from_mask(0, world)
    empty = comm.compressed_allreduce(torch.zeros(0), torch.zeros(0), torch.zeros(0), layout)
    out["empty"] = (empty.numel(), (comm.stats - before).as_dict())
    comm.close()
    try:
        comm.allreduce_mean(torch.ones(3))
        out["after_close"] = "no error"
    except RuntimeError as exc:
        out["after_close"] = str(exc)
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def world_results(request):
    world = request.param
    return world, run_ranks(_comm_checks, world, SIZES, timeout=180)


def test_result_is_bit_identical_on_every_rank(world_results):
    world, res = world_results
    for key in [f"outputs{n}" for n in SIZES] + ["masked_result", "after_nonfinite", "exact_mean"]:
        for r in res[1:]:
            assert torch.equal(res[0][key], r[key]), key
    for r in res[1:]:
        for a, b in zip(res[0]["inflight"], r["inflight"]):
            assert torch.equal(a, b)


def _reference_rounds(inputs, world, keep, starts):
    """The two-stage error-compensated 1-bit average, written out plainly for ``world`` simulated ranks.

    ``inputs[r][t]`` is rank r's vector at round t. Segments are cut at ``starts`` and at chunk
    starts; a segment's scale is the RMS of its unmasked elements; sign(+0.0) = +1, sign(-0.0) = -1.
    Returns the outputs of every round and every rank's final worker and server errors.
    """
    n = keep.numel()
    quantum = 8 * world
    padded = -(-n // quantum) * quantum
    chunk = padded // world
    mask = torch.zeros(padded, dtype=torch.bool)
    mask[:n] = keep
    cuts = sorted(set(starts) | {k * chunk for k in range(world)} | {padded})

    def compress(v, offset):
        """C[v] for v holding positions offset .. offset + len(v) of the padded vector."""
        res = torch.zeros_like(v)
        edges = [c - offset for c in cuts if offset <= c <= offset + v.numel()]
        for a, b in zip(edges[:-1], edges[1:]):
            m = mask[offset + a : offset + b]
            seg = v[a:b] * m
            count = int(m.sum())
            scale = seg.norm() / math.sqrt(count) if count else torch.tensor(0.0)
            res[a:b] = torch.where(torch.signbit(seg), -scale, scale)
        return res

    we = [torch.zeros(padded) for _ in range(world)]
    se = [torch.zeros(chunk) for _ in range(world)]
    outputs = []
    for t in range(len(inputs[0])):
        compressed = []
        for r in range(world):
            y = torch.zeros(padded)
            y[:n] = inputs[r][t]
            y = (y + we[r]) * mask
            c = compress(y, 0)
            we[r] = (y - c) * mask
            compressed.append(c)
        result = torch.zeros(padded)
        for k in range(world):
            part = slice(k * chunk, (k + 1) * chunk)
            z = (sum(c[part] for c in compressed) / world + se[k]) * mask[part]
            cz = compress(z, k * chunk)
            se[k] = (z - cz) * mask[part]
            result[part] = cz * mask[part]
        outputs.append(result)
    return torch.stack(outputs), we, se


def test_matches_a_plain_reference_implementation(world_results):
    world, res = world_results
    n = 1003
    keep = torch.ones(n, dtype=torch.bool)
    keep[100:140] = False
    outputs, we, se = _reference_rounds([r["ref_inputs"] for r in res], world, keep, [17, 100, 500, 501, 900])
    # Same maths, different order of float operations: equal to float32 rounding.
    assert torch.allclose(res[0]["ref_outputs"], outputs, rtol=1e-5, atol=1e-6)
    for r in range(world):
        assert torch.allclose(res[r]["ref_we"], we[r], rtol=1e-5, atol=1e-5)
        assert torch.allclose(res[r]["ref_se"], se[r], rtol=1e-5, atol=1e-5)
    # and the reference's outputs are far from trivial: they track the exact mean over rounds
    exact = sum(r["ref_inputs"] for r in res) / world
    assert (outputs[:, :n] * keep).abs().sum() > 0
    assert not torch.allclose(outputs[:, :n] * keep, exact * keep, atol=1e-2)


def test_a_lane_rides_with_an_fp32_tensor_or_asked_in_bf16(world_results):
    """fp32 tensors carry the lane in their collective; bf16 ones only when asked (rounded like them), else a second."""
    from hf_zeroone.comm import fp32_allreduce_bytes

    world, res = world_results
    expected = torch.tensor([1.0 + (world - 1) / 2, 1e-3 * (world + 1) / 2, 3.14159 + (world - 1) / 2])
    for key, (tensor, lane, stats) in res[0]["lanes"].items():
        dtype = key.split()[0]
        tol = {"torch.float32": 1e-6, "torch.bfloat16": 1e-2, "torch.float16": 1e-3}[dtype]  # bits of mantissa
        assert torch.allclose(tensor, torch.full((8,), (world + 1) / 2), rtol=tol, atol=0), key
        size = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}[dtype]
        if key in ("torch.float32 False", "torch.bfloat16 True"):
            assert stats["collectives"] == 1, key
            assert stats["bytes_sent"] == fp32_allreduce_bytes(8 + 3, world, size), key
        else:  # the lane in a second collective, in fp32
            assert stats["collectives"] == 2, key
            assert stats["bytes_sent"] == fp32_allreduce_bytes(8, world, size) + fp32_allreduce_bytes(3, world), key
        lane_tol = 1e-2 if key == "torch.bfloat16 True" else 1e-6
        assert torch.allclose(lane, expected, rtol=lane_tol, atol=0), (key, lane, expected)
        for r in res[1:]:
            assert torch.equal(r["lanes"][key][1], lane), key


def test_exact_allreduce_is_the_mean(world_results):
    world, res = world_results
    expected = sum(range(world)) / world
    assert torch.allclose(res[0]["exact_mean"], torch.full((10,), expected))


@pytest.mark.parametrize("n", SIZES)
def test_error_feedback_telescopes(world_results, n):
    """Feeding constant inputs, the mean of T outputs approaches the exact mean like 1/T."""
    world, res = world_results
    exact = sum(r[f"x{n}"] for r in res) / world
    outputs = res[0][f"outputs{n}"][:, :n]

    def rel_err(t):
        return ((outputs[:t].mean(0) - exact).norm() / exact.norm()).item()

    e25, e200 = rel_err(25), rel_err(200)
    # A single 1-bit round is far off; averaging over rounds removes the error ~ 1/T.
    assert e200 < 0.05, (e25, e200)
    assert e200 < 0.35 * e25 + 1e-6, (e25, e200)
    # The sum of outputs stays within a bounded distance of T * exact (the telescoping bound).
    drift = (outputs.sum(0) - 200 * exact).norm() / exact.norm()
    assert drift < 10.0


@pytest.mark.parametrize("n", SIZES)
def test_bytes_counted_match_the_formula(world_results, n):
    world, res = world_results
    stats = res[0][f"stats{n}"]
    layout = ChunkLayout.from_mask(n, world)
    assert layout.segments_per_chunk == 1
    per_call = 2 * (world - 1) / world * layout.padded / 8 + 2 * (world - 1) * 4
    assert stats["bytes_sent"] == pytest.approx(200 * per_call)
    assert stats["collectives"] == 400
    assert stats["compressed_allreduces"] == 200
    assert stats["fp32_equivalent_bytes"] == 200 * fp32_allreduce_bytes(n, world)
    if n == 20001:  # large enough for the 1/32 floor to show
        assert stats["fp32_equivalent_bytes"] / stats["bytes_sent"] > 28


def test_masked_elements_are_zero_and_keep_no_error(world_results):
    world, res = world_results
    for r in res:
        assert r["masked_result"][5:15].eq(0).all()
        assert r["masked_we"][5:15].eq(0).all()
        assert r["masked_result"][40:].eq(0).all()  # padding
        assert r["masked_we"][40:].eq(0).all()
        assert r["masked_result"][:5].ne(0).all()


def test_non_finite_on_one_rank_reaches_every_rank_and_spares_errors(world_results):
    world, res = world_results
    for r in res:
        assert torch.isnan(r["nonfinite_result"]).all()
        assert r["nonfinite_errors_unchanged"]
        assert torch.isfinite(r["after_nonfinite"]).all()


def test_empty_input_sends_nothing(world_results):
    world, res = world_results
    numel, stats = res[0]["empty"]
    assert numel == 0 and stats["bytes_sent"] == 0 and stats["collectives"] == 0


def test_a_closed_communicator_refuses_work_with_a_clear_error(world_results):
    world, res = world_results
    for r in res:
        assert "Communicator was closed" in r["after_close"]


def test_single_process_communicator_is_local_and_free():
    comm = Communicator()
    assert comm.world_size == 1 and not comm.is_distributed
    layout = ChunkLayout.from_mask(10, 1)
    x = torch.randn(layout.padded)
    out = comm.compressed_allreduce(x.clone(), torch.zeros(layout.padded), torch.zeros(layout.chunk), layout)
    assert torch.equal(out[:10], x[:10])
    assert comm.allreduce_mean(x) is x
    assert comm.stats == CommStats()


def test_bad_buffers_raise_clear_errors():
    comm = Communicator()
    layout = ChunkLayout.from_mask(10, 1)
    with pytest.raises(ValueError, match="worker_error must be a contiguous float32 tensor of 16"):
        comm.compressed_allreduce(torch.zeros(16), torch.zeros(10), torch.zeros(16), layout)
    with pytest.raises(ValueError, match="world_size=2"):
        comm.compressed_allreduce(torch.zeros(16), torch.zeros(16), torch.zeros(8), ChunkLayout.from_mask(10, 2))


def test_stats_arithmetic():
    a = CommStats(bytes_sent=10, collectives=2, fp32_equivalent_bytes=320)
    b = a.copy()
    b.bytes_sent += 5
    assert (b - a).bytes_sent == 5 and (a + a).collectives == 4
    assert a.compression_ratio == 32.0
    assert math.isinf(CommStats().compression_ratio)
