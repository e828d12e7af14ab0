import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_zeroone.compression import (
    ChunkLayout,
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


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(min_value=0, max_value=300), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(nbytes, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nbytes * 8, generator=g)
    x[torch.rand(x.shape, generator=g) < 0.1] = 0.0  # zeros count as +1
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == nbytes
    signs = unpack_signs(packed)
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(signs, expected)


def test_pack_bit_order_first_element_is_most_significant():
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 1])
    assert pack_signs(x).tolist() == [128, 1]


def test_pack_batched_rows_and_dtypes():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    packed = pack_signs(x)
    assert packed.shape == (3, 2)
    assert torch.equal(unpack_signs(packed, torch.float64), torch.where(x >= 0, 1.0, -1.0).double())


def test_pack_rejects_partial_bytes_and_unpack_rejects_non_bytes():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.randn(9))
    with pytest.raises(TypeError, match="uint8"):
        unpack_signs(torch.zeros(2, dtype=torch.int32))


def test_segment_scales_ignore_masked_entries_and_empty_segments():
    x = torch.tensor([3.0, 4.0, 0.0, 0.0, 1.0, 1.0])
    ids = torch.tensor([0, 0, 0, 2, 2, 2])
    scales = segment_scales(x, ids, torch.tensor([2.0, 0.0, 3.0]))
    assert torch.allclose(scales, torch.tensor([5.0 / 2**0.5, 0.0, (2.0 / 3.0) ** 0.5]))


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
        assert torch.equal(layout.segment_ids, torch.arange(world_size).repeat_interleave(layout.chunk))


def test_layout_segments_split_at_tensor_starts_and_chunk_starts():
    # three tensors of 5, 20 and 7 elements on 2 ranks: 32 elements, chunks of 16
    layout = ChunkLayout.from_mask(32, 2, segment_starts=[0, 5, 25])
    assert layout.chunk == 16 and layout.segments_per_chunk == 2
    # chunk 0: [0,5) [5,16); chunk 1: [16,25) [25,32)
    expected = [0] * 5 + [1] * 11 + [2] * 9 + [3] * 7
    assert layout.segment_ids.tolist() == expected
    assert layout.segment_counts.tolist() == [5.0, 11.0, 9.0, 7.0]
    assert layout.chunk_segment_ids(1).tolist() == [0] * 9 + [1] * 7
    # a chunk with fewer segments leaves unused (empty) slots
    layout = ChunkLayout.from_mask(20, 2, segment_starts=[3, 6])  # chunks of 16: 3 segments | 1
    assert layout.segments_per_chunk == 3
    assert layout.segment_counts.tolist() == [3.0, 3.0, 10.0, 4.0, 0.0, 0.0]


def test_layout_with_element_mask():
    keep = torch.tensor([True, False, True, True, False, True, True, True, True, True])
    layout = ChunkLayout.from_mask(10, 2, keep)
    assert layout.padded == 16 and not layout.fully_unmasked
    assert layout.segment_counts.tolist() == [6.0, 2.0]
    with pytest.raises(ValueError, match="element_mask has 3 elements"):
        ChunkLayout.from_mask(10, 2, torch.ones(3, dtype=torch.bool))
