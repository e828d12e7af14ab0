"""Stream ordering on one GPU: producers and consumers on side streams, no host sync per bucket.

A slow kernel (``torch.cuda._sleep``) on the producer's stream runs before the producer writes
the input; without the event the communicator's stream would read the input early. The
consumers read on other streams; without CUDA-aware futures they would read the result early.
"""

import pytest
import torch

from hf_zeroone._executor import _SerialExecutor
from hf_zeroone.comm import Communicator
from hf_zeroone.compression import ChunkLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible here")

CUDA = torch.device("cuda", 0)
SLEEP = 50_000_000  # GPU cycles: tens of milliseconds


def test_a_job_reads_its_input_after_the_producer_stream_wrote_it():
    executor = _SerialExecutor("test-streams")
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1 << 20, device=CUDA)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SLEEP)
        x.fill_(3.0)
        fut = executor.submit(lambda: x * 2, (x,))
    with torch.cuda.stream(consumer):
        value = fut.wait()  # the consumer's stream waits for the job's stream
        total = value.sum()
    consumer.synchronize()
    assert total.item() == 6.0 * x.numel()
    assert executor.streams[CUDA] not in (producer, consumer, torch.cuda.default_stream(CUDA))
    executor.shutdown(timeout=10)


def test_then_callbacks_see_the_result_and_hand_on_a_cuda_aware_future():
    executor = _SerialExecutor("test-then")
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device=CUDA)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        x.fill_(1.0)
        fut = executor.submit(lambda: x + 1, (x,))
        chained = fut.then(lambda f: f.value() * 10)  # runs on a pool stream synchronised with the job
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        out = chained.wait().sum()
    other.synchronize()
    assert out.item() == 20.0 * x.numel()
    executor.shutdown(timeout=10)


def _rounds(comm, layout, device, producer):
    we = torch.zeros(layout.padded, device=device)
    se = torch.zeros(layout.chunk, device=device)
    g = torch.Generator().manual_seed(3)
    sources = [torch.randn(layout.padded, generator=g).to(device) for _ in range(4)]
    torch.cuda.synchronize()
    outs = []
    for src in sources:
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SLEEP // 10)
            buf = src.clone()  # written on the producer's stream, after the sleep
            outs.append(comm.compressed_allreduce_async(buf, we, se, layout))
            del buf  # the job holds the last reference; record_stream guards its memory once freed
    return [f.wait() for f in outs], we, se


def test_the_threaded_communicator_on_side_streams_equals_an_inline_run():
    layout = ChunkLayout.from_mask(300_001, 4, None, CUDA, segment_starts=[1000, 150_000])
    threaded, inline = Communicator._loopback(4, rank=2), Communicator._loopback(4, rank=2, threaded=False)
    producer = torch.cuda.Stream()
    a = _rounds(threaded, layout, CUDA, producer)
    b = _rounds(inline, layout, CUDA, torch.cuda.current_stream())
    torch.cuda.synchronize()
    for x, y in zip(a[0] + [a[1], a[2]], b[0] + [b[1], b[2]]):
        assert torch.equal(x, y)
    threaded.close()


def test_a_compressed_allreduce_does_not_sync_the_host():
    comm = Communicator._loopback(4, rank=1)
    layout = ChunkLayout.from_mask(100_000, 4, torch.arange(100_000) % 5 != 0, CUDA, segment_starts=[777])
    we, se = torch.zeros(layout.padded, device=CUDA), torch.zeros(layout.chunk, device=CUDA)
    comm.compressed_allreduce(torch.randn(layout.padded, device=CUDA), we, se, layout)  # warm caches
    bad = torch.randn(layout.padded, device=CUDA)
    bad[3] = float("nan")  # before the check: writing a Python number copies it from the host
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        futs = [
            comm.compressed_allreduce_async(torch.randn(layout.padded, device=CUDA), we, se, layout),
            comm.compressed_allreduce_async(bad, we, se, layout),
            comm.allreduce_mean_async(torch.ones(4, device=CUDA)),
        ]
        values = [f.then(lambda f: f.value() * 1).wait() for f in futs]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(values[0]).all() and torch.isnan(values[1]).all()
    comm.close()
