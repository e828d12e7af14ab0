"""Compression kernels on CUDA against the CPU: bit for bit where the maths is exact.

Packing, unpacking, decompressing with given scales and the compression error with given scales
are exact operations (sign bits, +-1 times a scale, copysign and one correctly rounded
subtraction), so CUDA must give the CPU's bits. Segment scales are norms (reductions in another
order): equal to float32 rounding.
"""

import pytest
import torch

from hf_zeroone.comm import Communicator
from hf_zeroone.compression import ChunkLayout, compression_error, decompress, pack_signs, segment_scales, unpack_signs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible here")

CUDA = torch.device("cuda")


def _inputs(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(dtype)
    x[::97] = 0.0
    x[1::97] = -0.0
    x[2::101] = float("inf")
    x[3::101] = -float("inf")
    x[4::103] = torch.finfo(dtype).tiny / 2  # subnormal (or zero in formats without them)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [8, 1000, 2**20 + 8])
def test_pack_and_unpack_are_bit_identical(dtype, n):
    x = _inputs(n, dtype)
    for shaped in (x, x.view(-1, 8)):
        packed = pack_signs(shaped)
        packed_cuda = pack_signs(shaped.to(CUDA))
        assert torch.equal(packed_cuda.cpu(), packed)
        for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert torch.equal(unpack_signs(packed_cuda, out_dtype).cpu(), unpack_signs(packed, out_dtype))


def test_decompress_and_compression_error_are_bit_identical_with_given_scales():
    n = 4096
    bounds = (0, 5, 5, 1000, 3000, n)  # an empty segment too
    x = _inputs(n, torch.float32, seed=1)
    x[~torch.isfinite(x)] = 1.5
    scales = torch.tensor([0.3, 0.0, 1e-30, 7.25, 3.0e38])
    packed = pack_signs(x)
    cpu = decompress(packed, scales, bounds)
    assert torch.equal(decompress(packed.to(CUDA), scales.to(CUDA), bounds).cpu(), cpu)
    out = compression_error(x, scales, bounds, out=torch.empty(n))
    out_cuda = compression_error(x.to(CUDA), scales.to(CUDA), bounds, out=torch.empty(n, device=CUDA))
    assert torch.equal(out_cuda.cpu().view(torch.int32), out.view(torch.int32))


def test_segment_scales_agree_to_float32_rounding():
    n = 100_003
    x = torch.randn(n) * torch.linspace(1e-3, 10, n)
    bounds = (0, 17, 17, 5000, 99_000, n)
    counts = torch.tensor([17.0, 0.0, 4983.0, 94_000.0, 1003.0])
    cpu = segment_scales(x, bounds, counts)
    cuda = segment_scales(x.to(CUDA), bounds, counts.to(CUDA)).cpu()
    assert torch.allclose(cuda, cpu, rtol=2e-6, atol=0) and cuda[1] == 0


@pytest.mark.parametrize("world", [2, 3, 8])
def test_the_whole_compressed_allreduce_arithmetic_agrees_with_the_cpu(world):
    """One rank's arithmetic (collectives replaced by a loopback), several rounds of error feedback."""
    n = 50_001
    keep = torch.ones(n, dtype=torch.bool)
    keep[100:900] = False
    results = {}
    for device in ("cpu", "cuda"):
        layout = ChunkLayout.from_mask(n, world, keep, device, segment_starts=[17, 1000, 25_000])
        comm = Communicator._loopback(world, rank=world - 1)
        we = torch.zeros(layout.padded, device=device)
        se = torch.zeros(layout.chunk, device=device)
        g = torch.Generator().manual_seed(5)
        outs = []
        for _ in range(5):
            buf = torch.zeros(layout.padded)
            buf[:n] = torch.randn(n, generator=g)
            outs.append(comm.compressed_allreduce(buf.to(device), we, se, layout).cpu())
        results[device] = (torch.stack(outs), we.cpu(), se.cpu())
        comm.close()
    (out_cpu, we_cpu, se_cpu), (out_cuda, we_cuda, se_cuda) = results["cpu"], results["cuda"]
    assert torch.allclose(out_cuda, out_cpu, rtol=1e-4, atol=1e-6), (out_cuda - out_cpu).abs().max()
    assert torch.allclose(we_cuda, we_cpu, rtol=1e-4, atol=1e-6), (we_cuda - we_cpu).abs().max()
    # The loopback's ranks all send this rank's signs, so the server's average is its own 1-bit
    # image and the server error holds only rounding residue: each device's float32 rounding of
    # the segment scales (a sum of thousands of equal values, sequential on the CPU, a tree on
    # CUDA). Up to 4.9e-5 on the CPU (400 units in the last place of the outputs); on an H200
    # the first elements differed from the CPU's by up to 1.7e-5. Compared at the outputs'
    # scale, where a wrong sign or scale would show as a difference of order one.
    scale = out_cpu.abs().max()
    assert torch.allclose(se_cuda, se_cpu, rtol=0, atol=5e-4 * scale), (se_cuda - se_cpu).abs().max()


def test_decompressing_into_a_given_buffer_is_bit_identical():
    n = 4096
    bounds = (0, 5, 5, 1000, 3000, n)
    x = _inputs(n, torch.float32, seed=2)
    scales = torch.tensor([0.3, 0.0, 1e-30, 7.25, 3.0e38])
    packed = pack_signs(x)
    out = torch.full((n,), 9.0, device=CUDA)
    assert decompress(packed.to(CUDA), scales.to(CUDA), bounds, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out.cpu().view(torch.int32), decompress(packed, scales, bounds).view(torch.int32))


def test_the_float8_codec_and_allreduce_are_bit_identical_to_the_cpu():
    """Block maxima, powers of two and the round-to-nearest cast are exact: CUDA gives the CPU's codes."""
    from hf_zeroone.float8 import FLOAT8_BLOCK, decode_float8, encode_float8

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64 * FLOAT8_BLOCK, generator=g) * torch.exp(torch.randn(64 * FLOAT8_BLOCK, generator=g) * 6)
    x[::7] = -0.0
    x[5 * FLOAT8_BLOCK + 3] = float("nan")
    codes, exponents = encode_float8(x)
    codes_cuda, exponents_cuda = encode_float8(x.to(CUDA))
    assert torch.equal(exponents_cuda.cpu(), exponents)
    finite = torch.isfinite(x.view(-1, FLOAT8_BLOCK)).all(dim=1).repeat_interleave(FLOAT8_BLOCK)
    assert torch.equal(codes_cuda.cpu()[finite], codes[finite])  # a NaN block's codes are never read
    cpu, cuda = decode_float8(codes, exponents), decode_float8(codes_cuda, exponents_cuda).cpu()
    assert torch.equal(cuda[finite].view(torch.int32), cpu[finite].view(torch.int32))
    assert torch.isnan(cuda[~finite]).all() and torch.isnan(cpu[~finite]).all()
    sizes = [1000, 3, 130, 257, 64]
    y = torch.randn(sum(sizes), generator=g)
    for world in (2, 3):
        on_cpu = Communicator._loopback(world, rank=world - 1, threaded=False)
        on_cuda = Communicator._loopback(world, rank=world - 1, threaded=False)
        a = on_cpu.float8_allreduce_async(y.clone(), sizes).wait()
        b = on_cuda.float8_allreduce_async(y.to(CUDA), sizes).wait().cpu()
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), world
        on_cpu.close()
        on_cuda.close()
