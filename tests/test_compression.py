import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_zeroone.compression import (
    ChunkLayout,
    _pack_signs_torch,
    _unpack_signs_elementwise,
    compression_error,
    decompress,
    pack_signs,
    padded_length,
    segment_scales,
    unpack_signs,
)

WORLD_SIZES = [1, 2, 3, 4, 5, 8]
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 23, 24, 25, 63, 64, 65, 1000, 1001]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("n", SIZES)
def test_padded_length_is_smallest_whole_byte_split(n, world_size):
    padded = padded_length(n, world_size)
    assert padded >= n
    assert padded % (8 * world_size) == 0
    assert padded - n < 8 * world_size
    if n == 0:
        assert padded == 0


def test_padded_length_rejects_bad_input():
    with pytest.raises(ValueError, match="numel"):
        padded_length(-1, 2)
    with pytest.raises(ValueError, match="world_size"):
        padded_length(8, 0)


def _expected_signs(x: torch.Tensor) -> torch.Tensor:
    """+1 where the sign bit is clear (including +0.0), -1 where it is set (including -0.0)."""
    return torch.where(torch.signbit(x), -1.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(min_value=0, max_value=300), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip_and_both_pack_paths_agree(nbytes, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nbytes * 8, generator=g)
    x[torch.rand(x.shape, generator=g) < 0.1] = 0.0
    x[torch.rand(x.shape, generator=g) < 0.1] = -0.0
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == nbytes
    # the NumPy path (CPU) and the torch-only path (other devices) give the same bytes
    assert torch.equal(_pack_signs_torch(x), packed)
    assert torch.equal(unpack_signs(packed), _expected_signs(x))
    # the torch-only unpack path (dtypes NumPy lacks) decodes the same signs
    assert torch.equal(unpack_signs(packed, torch.bfloat16).float(), _expected_signs(x))
    # and so does the accelerators' element-wise form, run here on the CPU
    for dtype in (torch.float32, torch.bfloat16):
        elementwise = _unpack_signs_elementwise(packed, dtype).reshape(-1)
        assert elementwise.dtype == dtype and torch.equal(elementwise.float(), _expected_signs(x))


def test_pack_bit_order_first_element_is_most_significant():
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 1])
    assert pack_signs(x).tolist() == [128, 1]
    assert _pack_signs_torch(x).tolist() == [128, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_both_pack_paths_read_the_sign_bit_of_nans_infinities_and_subnormals(dtype):
    tiny = torch.finfo(dtype).tiny
    values = [float("nan"), -float("nan"), float("inf"), -float("inf"), tiny / 2, -tiny / 2, 0.0, -0.0]
    x = torch.tensor(values, dtype=torch.float64).to(dtype)  # float64 first: its subnormals survive
    expected = sum(1 << (7 - j) for j, negative in enumerate(torch.signbit(x).tolist()) if not negative)
    assert expected & 0b00101010 == 0b00101010  # +inf, +tiny/2 and +0.0 (a cast may set a NaN's sign)
    assert _pack_signs_torch(x).tolist() == pack_signs(x).tolist() == [expected]
    assert _pack_signs_torch(x.view(1, 8).expand(3, 8)).tolist() == [[expected]] * 3
    transposed = torch.stack([x] * 3, dim=1).t()  # rows of 8 whose last dimension has stride 3
    assert _pack_signs_torch(transposed).tolist() == [[expected]] * 3


def test_float8_signs_pack_and_unpack():
    x = torch.tensor([1.5, -2.0, 0.0, -0.0, 448.0, -0.001953125, 3.0, -1.0])  # each exact in float8_e4m3fn
    packed = pack_signs(x.to(torch.float8_e4m3fn))
    assert packed.tolist() == pack_signs(x).tolist() == [0b10101010]
    assert torch.equal(unpack_signs(packed), _expected_signs(x))


def test_pack_reads_the_sign_bit_of_zeros():
    x = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -1.0, 0.0, 0.0])
    assert pack_signs(x).tolist() == [0b10101011]


def test_pack_batched_rows_and_dtypes():
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        x = torch.randn(3, 16, dtype=dtype)
        packed = pack_signs(x)
        assert packed.shape == (3, 2)
        assert torch.equal(_pack_signs_torch(x), packed)
        assert torch.equal(unpack_signs(packed, torch.float64), _expected_signs(x).double())
    assert unpack_signs(torch.zeros(3, 2, dtype=torch.uint8)).shape == (3, 16)


def test_pack_rejects_partial_bytes_and_unpack_rejects_non_bytes():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.randn(9))
    with pytest.raises(TypeError, match="uint8"):
        unpack_signs(torch.zeros(2, dtype=torch.int32))


def test_segment_scales_ignore_masked_entries_and_empty_segments():
    x = torch.tensor([3.0, 4.0, 0.0, 0.0, 1.0, 1.0])
    # segments [0, 3) with 2 unmasked elements, [3, 3) empty, [3, 6) with 3
    scales = segment_scales(x, (0, 3, 3, 6), torch.tensor([2.0, 0.0, 3.0]))
    assert torch.allclose(scales, torch.tensor([5.0 / 2**0.5, 0.0, (2.0 / 3.0) ** 0.5]))
    with pytest.raises(ValueError, match="bounds must run from 0 to 6"):
        segment_scales(x, (0, 3, 5), torch.tensor([2.0, 3.0]))
    with pytest.raises(ValueError, match="one entry more than the 3 segments"):
        segment_scales(x, (0, 3, 6), torch.tensor([2.0, 0.0, 3.0]))


@settings(max_examples=100, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 64), max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_error_is_input_minus_decompressed_signs_exactly(cuts, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, generator=g) * torch.rand(64, generator=g) * 10
    x[::7] = -0.0
    bounds = (0, *sorted(cuts), 64)
    counts = torch.tensor([float(b - a) for a, b in zip(bounds[:-1], bounds[1:])])
    scales = segment_scales(x, bounds, counts)
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b > a:
            assert torch.allclose(scales[j], x[a:b].norm() / (b - a) ** 0.5)
    approx = decompress(pack_signs(x), scales, bounds)
    # C[x] = copysign(scale, x) on each segment, the signs being the ones that were packed
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        assert torch.equal(approx[a:b], torch.copysign(scales[j].expand(b - a), x[a:b]))
    error = compression_error(x, scales, bounds, out=torch.empty_like(x))
    assert torch.equal(error, x - approx)


@settings(max_examples=100, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 80), max_size=8),
    seed=st.integers(0, 2**31 - 1),
)
def test_scales_expanded_per_element_give_the_bits_of_the_slice_by_slice_form(cuts, seed):
    """The accelerators' form (one gather of the scales, whatever the segments) against the CPU's slices.

    Empty segments anywhere (first, last, repeated cuts) own no element; a NaN scale (a bad
    step) and signed zeros come out the same.
    """
    import hf_zeroone.compression as compression

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(80, generator=g) * 3
    x[::5] = -0.0
    bounds = (0, *sorted(cuts), 80)
    scales = torch.rand(len(bounds) - 1, generator=g)
    scales[len(scales) // 2] = float("nan")
    packed = pack_signs(x)
    results = []
    kept = compression.EXPAND_BELOW
    for below in (0, 1 << 62):  # slices, then expanded
        compression.EXPAND_BELOW = below
        try:
            error = compression_error(x, scales, bounds, out=torch.empty_like(x))
            results.append((error.view(torch.int32), decompress(packed, scales, bounds).view(torch.int32)))
        finally:
            compression.EXPAND_BELOW = kept
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("n", SIZES)
def test_layout_masks_padding_and_counts_real_elements(n, world_size):
    layout = ChunkLayout.from_mask(n, world_size)
    assert layout.padded == padded_length(n, world_size)
    assert layout.chunk * world_size == layout.padded and layout.chunk % 8 == 0
    assert layout.mask.sum().item() == n
    assert layout.mask[:n].eq(1).all() and layout.mask[n:].eq(0).all()
    assert layout.segment_counts.sum().item() == n
    assert layout.fully_unmasked
    if n:  # with no segment starts, one segment per chunk
        assert layout.segments_per_chunk == 1
        assert layout.bounds == tuple(k * layout.chunk for k in range(world_size + 1))


def test_layout_segments_split_at_tensor_starts_and_chunk_starts():
    # three tensors of 5, 20 and 7 elements on 2 ranks: 32 elements, chunks of 16
    layout = ChunkLayout.from_mask(32, 2, segment_starts=[0, 5, 25])
    assert layout.chunk == 16 and layout.segments_per_chunk == 2
    # chunk 0: [0,5) [5,16); chunk 1: [16,25) [25,32)
    assert layout.bounds == (0, 5, 16, 25, 32)
    assert layout.segment_counts.tolist() == [5.0, 11.0, 9.0, 7.0]
    assert layout.chunk_bounds(1) == (0, 9, 16)
    assert layout.chunk_segment_counts(1).tolist() == [9.0, 7.0]
    # a chunk with fewer segments ends with empty ones
    layout = ChunkLayout.from_mask(20, 2, segment_starts=[3, 6])  # chunks of 16: 3 segments | 1
    assert layout.segments_per_chunk == 3
    assert layout.bounds == (0, 3, 6, 16, 32, 32, 32)
    assert layout.chunk_bounds(1) == (0, 16, 16, 16)
    assert layout.segment_counts.tolist() == [3.0, 3.0, 10.0, 4.0, 0.0, 0.0]


def test_layout_with_element_mask():
    keep = torch.tensor([True, False, True, True, False, True, True, True, True, True])
    layout = ChunkLayout.from_mask(10, 2, keep)
    assert layout.padded == 16 and not layout.fully_unmasked
    assert layout.segment_counts.tolist() == [6.0, 2.0]
    assert layout.stored_mask is layout.mask and layout.mask.tolist() == keep.float().tolist() + [0.0] * 6
    assert layout.mask.dtype == torch.uint8  # one byte per element (torch's multiplication promotes it)
    # a mask that keeps everything is no mask: nothing stored, the padding alone is masked
    everything = ChunkLayout.from_mask(10, 2, torch.ones(10, dtype=torch.bool))
    assert (
        everything.fully_unmasked
        and everything.stored_mask is None
        and everything.tensors() == (everything.segment_counts,)
    )
    assert everything.mask.tolist() == [1.0] * 10 + [0.0] * 6 and everything.mask.dtype == torch.uint8
    with pytest.raises(ValueError, match="element_mask has 3 elements"):
        ChunkLayout.from_mask(10, 2, torch.ones(3, dtype=torch.bool))


def test_segments_go_a_run_at_a_time_when_runs_are_few_or_long_and_are_expanded_otherwise():
    """Per run, a launch costs more than expanding short segments and less than long ones."""
    from hf_zeroone._runs import PIECES_PER_RUN, runs
    from hf_zeroone.compression import EXPAND_BELOW, _runs

    same = tuple(range(0, 64 * 1000 + 1, 1000))  # 64 segments of 1,000 elements: one run
    assert _runs(same) == [(0, 1, 0, 1000, 64, 1000)]
    interleaved = tuple(np.cumsum([0] + [1000 + (i % 2) for i in range(64)]).tolist())  # weights and biases
    assert _runs(interleaved) == [(0, 2, 0, 2001, 32, 1000), (1, 2, 1000, 2001, 32, 1001)]
    varied = tuple(np.cumsum([0] + [1000 + i for i in range(64)]).tolist())  # no two segments alike
    assert _runs(varied) is None
    assert _runs((0, EXPAND_BELOW, 2 * EXPAND_BELOW + 1)) is not None  # two long segments
    # empty segments own no element and need no launch: they are in no run
    assert runs([0, 0, 5, 0, 4]) == [(2, 1, 0, 1, 1, 5), (4, 1, 5, 1, 1, 4)]
    blocks = (0, *range(3, 3 + 256 * 2 * PIECES_PER_RUN, 256), 3 + 256 * 2 * PIECES_PER_RUN)
    assert len(_runs(blocks)) == 2  # a short first piece, then blocks of 256


@pytest.mark.parametrize("form", ["numpy", "bf16", "elementwise"])
def test_unpacking_and_decompressing_into_a_given_buffer_writes_the_same_bits_there(form):
    """``out=`` (the compressed allreduce's reuse of its message's memory) changes no bit, on every path.

    numpy: the CPU's float32 path; bf16: a dtype NumPy lacks; elementwise: the accelerators'.
    """
    dtype = torch.bfloat16 if form == "bf16" else torch.float32
    g = torch.Generator().manual_seed(3)
    packed = pack_signs(torch.randn(2, 40, generator=g))
    out = torch.full((80,), 7.0, dtype=dtype)
    if form == "elementwise":
        fresh = _unpack_signs_elementwise(packed, dtype)
        assert _unpack_signs_elementwise(packed, dtype, out=out.view(-1, 8)).data_ptr() == out.data_ptr()
    else:
        fresh = unpack_signs(packed, dtype)
        assert unpack_signs(packed, dtype, out=out) is out
    assert torch.equal(out, fresh.reshape(-1))
    bounds, scales = (0, 13, 13, 80), torch.tensor([0.5, 2.0, 0.25])
    into = torch.empty(80)
    assert decompress(packed, scales, bounds, out=into).data_ptr() == into.data_ptr()
    assert torch.equal(into.view(torch.int32), decompress(packed, scales, bounds).view(torch.int32))


def test_unpacking_into_a_wrong_buffer_is_refused_before_anything_is_written():
    packed = pack_signs(torch.randn(16))
    for bad in (torch.zeros(8), torch.zeros(16, dtype=torch.float64), torch.zeros(32)[::2]):
        before = bad.clone()
        with pytest.raises(ValueError, match="out must be a contiguous"):
            unpack_signs(packed, out=bad)
        assert torch.equal(bad, before)


@pytest.mark.parametrize(
    "lengths",
    [
        [64] * 40,
        [64, 8] * 20,
        [64, 8, 8, 4] * 6 + [64, 8],
        [3] + [256] * 30 + [100, 7] + [256] * 12 + [2],
        [0, 50, 50, 0, 50, 10],
    ],
)
def test_a_run_at_a_time_gives_the_bits_of_one_segment_at_a_time(lengths, monkeypatch):
    """Runs of same-length segments (a bucket of same-shaped tensors, 1-bit DiLoCo's blocks) against the
    multi-tensor norms and the expanded scales."""
    import hf_zeroone._runs as tensors
    import hf_zeroone.compression as compression

    bounds = tuple(np.cumsum([0, *lengths]).tolist())
    g = torch.Generator().manual_seed(len(lengths))
    x = torch.randn(bounds[-1], generator=g) * torch.rand(bounds[-1], generator=g).exp()
    x[::7] = -0.0
    counts = torch.tensor([float(n) for n in lengths])
    packed = pack_signs(x)
    results = []
    for per_run in (1, 1 << 30):  # a run at a time, then every segment at once
        monkeypatch.setattr(tensors, "PIECES_PER_RUN", per_run)
        assert (compression._runs(bounds) is not None) == (per_run == 1)
        scales = segment_scales(x, bounds, counts)
        error = compression_error(x, scales, bounds, out=torch.empty_like(x))
        results.append([t.view(torch.int32) for t in (scales, error, decompress(packed, scales, bounds))])
    for a, b in zip(*results):
        assert torch.equal(a, b)
