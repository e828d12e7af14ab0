"""``exact_step_dtype="float8_e4m3fn"``: the codec, the two-collective float8 average, the optimizers' use of it.

The training outcome (the same final loss as full-precision exact steps) is tested in
``test_convergence_defaults.py``.
"""

import math

import pytest
import torch

from hf_zeroone.float8 import FLOAT8_BLOCK, decode_float8, encode_float8

from _dist import run_ranks


def test_each_element_keeps_three_bits_of_mantissa_beside_much_larger_ones():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * FLOAT8_BLOCK, generator=g) * torch.logspace(-4, 2, 8 * FLOAT8_BLOCK)
    x[7] = 0.0
    codes, exponents = encode_float8(x)
    assert codes.dtype == exponents.dtype == torch.uint8 and codes.numel() == x.numel() and exponents.numel() == 8
    y = decode_float8(codes, exponents)
    assert y[7] == 0.0
    rel = (y - x).abs() / x.abs().clamp_min(1e-30)
    block_max = x.abs().view(-1, FLOAT8_BLOCK).amax(dim=1).repeat_interleave(FLOAT8_BLOCK)
    normal = x.abs() * 2**13 >= block_max  # within 2**13 of the block's largest: float8's normal range
    assert normal.float().mean() > 0.98 and x[~normal].abs().max() < 1e-3 * block_max.max()
    assert rel[normal & (x != 0)].max() <= 2**-4 + 1e-6  # round to nearest with 3 bits of mantissa
    assert ((y - x).abs()[~normal] <= block_max[~normal] * 2**-17).all()  # subnormals: absolute
    assert rel.mean() > 1e-3  # it is rounded: float8, not a copy
    # the block's largest maps into (224, 448]: the scale is a power of two, exact
    scaled = x.view(-1, FLOAT8_BLOCK).abs().amax(dim=1) * torch.exp2(-exponents.view(torch.int8).float())
    assert ((scaled > 224) & (scaled <= 448)).all(), scaled
    zero = encode_float8(torch.zeros(FLOAT8_BLOCK))
    assert torch.equal(decode_float8(*zero), torch.zeros(FLOAT8_BLOCK))


def test_a_non_finite_element_makes_its_block_nan_and_leaves_the_others():
    x = torch.randn(3 * FLOAT8_BLOCK)
    x[FLOAT8_BLOCK + 5] = float("inf")
    y = decode_float8(*encode_float8(x))
    assert torch.isnan(y[FLOAT8_BLOCK : 2 * FLOAT8_BLOCK]).all()
    assert torch.isfinite(y[:FLOAT8_BLOCK]).all() and torch.isfinite(y[2 * FLOAT8_BLOCK :]).all()


def _reference_encode(x):
    """The codec as first written (a new |x|, torch.ldexp, the cast): the rewrite must keep its bits."""
    blocks = x.view(-1, FLOAT8_BLOCK)
    amax = blocks.abs().amax(dim=1)
    mantissa, exponent = torch.frexp(amax / 448.0)
    exponent = exponent.sub_((mantissa == 0.5).to(exponent.dtype)).clamp_(-127, 127)
    exponent = exponent.masked_fill_(~torch.isfinite(amax), -128).to(torch.int8)
    scaled = torch.ldexp(blocks, -exponent.to(torch.float32).unsqueeze(1))
    return scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).view(-1), exponent.view(torch.uint8)


def _reference_decode(codes, exponents):
    exponent = exponents.view(torch.int8)
    values = codes.view(torch.float8_e4m3fn).to(torch.float32).view(-1, FLOAT8_BLOCK)
    values = torch.ldexp(values, exponent.to(torch.float32).unsqueeze(1))
    return values.masked_fill_((exponent == -128).unsqueeze(1), float("nan")).view(-1)


def test_the_codec_keeps_the_bits_of_its_first_form_on_zeros_subnormals_and_non_finite_blocks():
    """No new |x| nor ldexp output per element, a table lookup for the CPU's float8 to float32, a NaN
    factor per bad block: the same bits as the straightforward form, whatever the values."""
    from hf_zeroone.float8 import encode_float8_into

    g = torch.Generator().manual_seed(1)
    x = torch.randn(40 * FLOAT8_BLOCK, generator=g) * torch.exp(torch.randn(40 * FLOAT8_BLOCK, generator=g) * 10)
    x[::9] = -0.0
    x[4::17] = 1e-42  # float32 subnormals
    x[: 2 * FLOAT8_BLOCK] = torch.tensor([0.0, -0.0]).repeat_interleave(FLOAT8_BLOCK)  # all-zero blocks, both signs
    x[3 * FLOAT8_BLOCK + 1], x[5 * FLOAT8_BLOCK + 2], x[7 * FLOAT8_BLOCK] = float("nan"), float("inf"), -float("inf")
    codes, exponents = encode_float8(x)
    ref_codes, ref_exponents = _reference_encode(x.clone())
    assert torch.equal(codes, ref_codes) and torch.equal(exponents, ref_exponents)
    assert torch.equal(
        decode_float8(codes, exponents).view(torch.int32), _reference_decode(codes, exponents).view(torch.int32)
    )
    # every one of the 256 codes, in a normal block
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2)
    ones = torch.zeros(4, dtype=torch.uint8)
    assert torch.equal(decode_float8(every, ones).view(torch.int32), _reference_decode(every, ones).view(torch.int32))
    # into a strided row of a message (x is scratch): the same codes and exponents
    rows = torch.zeros(2, 40 * FLOAT8_BLOCK // 2 + 7, dtype=torch.uint8)
    scratch = x.clone()
    assert torch.equal(encode_float8_into(scratch, rows[:, : 20 * FLOAT8_BLOCK]), ref_exponents)
    assert torch.equal(rows[:, : 20 * FLOAT8_BLOCK].reshape(-1), ref_codes)


@pytest.mark.parametrize("bad", [torch.randn(100), torch.randn(128).double(), torch.randn(2, 128)])
def test_the_codec_refuses_what_it_cannot_encode(bad):
    with pytest.raises(ValueError, match="flat float32 tensor of whole 128-element blocks"):
        encode_float8(bad)


def _averages(rank, world):
    import torch

    from hf_zeroone.comm import Communicator

    comm = Communicator(torch.distributed.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    out = {}
    for n in (1, 300, 5000):
        x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
        lane = torch.tensor([1.0 + rank, 1e-3 * (rank + 1), 3.14159 + rank])
        before = comm.stats.copy()
        result = comm.float8_allreduce_async(x.clone(), exact=lane).wait()
        out[n] = (x, result, lane, (comm.stats - before).as_dict())
    # two pieces sent in either order: each piece's result is the same bits (blocks of its own)
    a, b = torch.randn(200, generator=g) * 100, torch.randn(77, generator=g)
    ab = comm.float8_allreduce_async(torch.cat([a, b]), [200, 77]).wait()
    ba = comm.float8_allreduce_async(torch.cat([b, a]), [77, 200]).wait()
    out["orders"] = (ab, ba)
    before = comm.stats.copy()
    comm.float8_allreduce_async(torch.cat([a, b]), [200, 77]).wait()
    out["pieces_bytes"] = (comm.stats - before).bytes_sent
    with pytest.raises(ValueError, match="add up to the tensor's 277 elements"):
        comm.float8_allreduce_async(torch.cat([a, b]), [200, 70])
    bad = torch.randn(1000, generator=g)
    if rank == 1:
        bad[3] = float("nan")
    out["bad"] = comm.float8_allreduce_async(bad).wait()
    with pytest.raises(ValueError, match="contiguous float32"):
        comm.float8_allreduce_async(torch.ones(8, dtype=torch.bfloat16))
    comm.close()
    return out


@pytest.fixture(scope="module", params=[2, 3])
def averages(request):
    return request.param, run_ranks(_averages, request.param, timeout=120)


def test_the_float8_average_is_the_mean_rounded_and_identical_on_every_rank(averages):
    from hf_zeroone._two_stage import SCALE_BYTES

    world, res = averages
    for n in (1, 300, 5000):
        mean = sum(r[n][0] for r in res) / world
        result = res[0][n][1]
        for r in res[1:]:
            assert torch.equal(r[n][1], result), n  # the same bytes decoded on every rank
            assert torch.equal(r[n][2], res[0][n][2]), n
        # each input rounded to 3 bits of mantissa (relative error 2**-4), then the mean again
        inputs = sum(r[n][0].abs() for r in res) / world
        err = (result - mean).abs()
        assert (err <= 2**-4 * inputs * (1 + 2**-4) + 2**-4 * mean.abs() + 1e-7).all(), (n, err.max())
        assert n == 1 or err.max() > 0  # rounded (a lone element is its block's largest: exact)
        lane = torch.tensor([1.0 + (world - 1) / 2, 1e-3 * (world + 1) / 2, 3.14159 + (world - 1) / 2])
        assert torch.allclose(res[0][n][2], lane, rtol=1e-6, atol=0)  # the lane exactly
        stats = res[0][n][3]
        blocks = math.ceil(n / FLOAT8_BLOCK)
        chunk = math.ceil(blocks / world) * FLOAT8_BLOCK
        row = chunk + chunk // FLOAT8_BLOCK + SCALE_BYTES * math.ceil(3 / world)  # codes, exponents, lane
        assert stats["bytes_sent"] == 2 * (world - 1) * row, (n, stats)
        assert stats["collectives"] == 2 and stats["full_allreduces"] == 1
    big = res[0][5000][3]  # a large message: about half of a bf16 allreduce's bytes
    bf16 = 2 * (world - 1) / world * 2 * (5000 + 3)
    assert 0.5 < big["bytes_sent"] / bf16 < 0.56, big  # the padding to 3 chunks of whole blocks: 7.5%


def test_each_piece_is_rounded_in_blocks_of_its_own_whatever_the_order(averages):
    """What lets the DDP hook and step() agree bit for bit when DDP's bucket orders the parameters differently."""
    from hf_zeroone._two_stage import float8_row_bytes

    world, res = averages
    ab, ba = res[0]["orders"]
    assert torch.equal(ab[:200], ba[77:]) and torch.equal(ab[200:], ba[:77])
    a_alone = sum(r["orders"][0][:200] for r in res)  # not trivially equal: rounded per block
    assert a_alone.abs().sum() > 0
    # padded to whole blocks piece by piece: 2 + 1 blocks of 128, split over the ranks
    assert res[0]["pieces_bytes"] == 2 * (world - 1) * float8_row_bytes([200, 77], 0, world)
    assert float8_row_bytes([200, 77], 0, world) == math.ceil(3 / world) * (128 + 1)


def test_a_nan_on_one_rank_reaches_every_rank(averages):
    world, res = averages
    for r in res:
        assert torch.isnan(r["bad"][:FLOAT8_BLOCK]).all()
        assert torch.isfinite(r["bad"][2 * FLOAT8_BLOCK :]).all()


def test_decoding_into_a_given_buffer_writes_the_same_bits_and_refuses_a_wrong_one():
    x = torch.randn(3 * FLOAT8_BLOCK)
    x[FLOAT8_BLOCK] = float("nan")
    codes, exponents = encode_float8(x)
    out = torch.full((3 * FLOAT8_BLOCK,), 5.0)
    assert decode_float8(codes, exponents, out=out) is out
    assert torch.equal(out.view(torch.int32), decode_float8(codes, exponents).view(torch.int32))
    for bad in (torch.zeros(FLOAT8_BLOCK), torch.zeros(3 * FLOAT8_BLOCK, dtype=torch.float64)):
        before = bad.clone()
        with pytest.raises(ValueError, match="out must be a contiguous float32 tensor"):
            decode_float8(codes, exponents, out=bad)
        assert torch.equal(bad, before)


def test_encoding_into_a_wrong_buffer_is_refused_before_anything_is_written():
    from hf_zeroone.float8 import encode_float8_into

    x = torch.randn(2 * FLOAT8_BLOCK)
    for bad in (torch.zeros(FLOAT8_BLOCK, dtype=torch.uint8), torch.zeros(2 * FLOAT8_BLOCK, dtype=torch.int16)):
        before = x.clone()
        with pytest.raises(ValueError, match="codes must be uint8 with 256 elements"):
            encode_float8_into(x, bad)
        assert torch.equal(x, before)
