"""The communicator's worker threads and where its compressed result is written."""

import pytest
import torch

from hf_zeroone.comm import Communicator
from hf_zeroone.compression import ChunkLayout

from _dist import run_ranks


def _worker_threads_after_drop(rank, world):
    import gc
    import threading

    import torch

    from hf_zeroone.comm import Communicator, _close_communicators_at_exit

    def workers():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("hf_zeroone-"))

    out = {}
    dropped = Communicator()
    dropped.allreduce_mean_async(torch.ones(3)).wait()
    cycle = [dropped]
    cycle.append(cycle)  # dropped inside a reference cycle, as an optimizer often is
    del dropped, cycle
    gc.collect()
    for t in threading.enumerate():
        if t.name.startswith("hf_zeroone-"):
            t.join(10.0)
    out["after_gc"] = workers()
    kept = Communicator()
    kept.allreduce_mean_async(torch.ones(3)).wait()
    out["while_kept"] = workers()
    _close_communicators_at_exit()  # what runs at interpreter exit
    out["after_exit_handler"] = workers()
    return out


def test_no_worker_thread_outlives_its_communicator_or_the_exit_handler():
    # A worker left running at interpreter exit can drop the last reference to a gloo group while
    # the interpreter finalises, which aborts the process (SIGABRT, "terminate called without an
    # active exception"): seen under `accelerate launch` once the optimizer was garbage-collected.
    for out in run_ranks(_worker_threads_after_drop, 2):
        assert out["after_gc"] == []
        assert len(out["while_kept"]) == 1
        assert out["after_exit_handler"] == []


def test_the_compressed_result_is_written_into_the_messages_memory():
    """No new vector of the message's size per call (on the CPU its page faults cost more than the
    arithmetic): the result comes back in ``buffer``'s memory, with the values a fresh result had."""
    layout = ChunkLayout.from_mask(1003, 4, None, segment_starts=[17, 500])
    comm = Communicator._loopback(4, rank=1, threaded=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(layout.padded, generator=g)
        x[layout.numel :] = 0
        buf = x.clone()
        we, se = torch.zeros(layout.padded), torch.zeros(layout.chunk)
        result = comm.compressed_allreduce(buf, we, se, layout)
        assert result.data_ptr() == buf.data_ptr()
        assert torch.equal(result[layout.numel :], torch.zeros(layout.padded - layout.numel))
        # every loopback rank sent x, so on this rank's chunk error feedback closes the books:
        # x = result + worker error + server error
        c = layout.chunk
        total = result.clone()
        total += we
        total[c : 2 * c] += se
        assert torch.allclose(total[c : 2 * c], x[c : 2 * c], atol=1e-5)
    comm.close()


def test_a_loopback_mean_is_the_input_every_simulated_rank_sends():
    """``Communicator._loopback(P)``: P ranks that send what this one sends average to it (was 1/P of it)."""
    for world in (2, 4):
        comm = Communicator._loopback(world, threaded=False)
        t = torch.tensor([1.0, -3.0, 0.25])
        assert torch.equal(comm.allreduce_mean(t.clone()), t)
        comm.close()


@pytest.mark.parametrize("world", [1, 2])
def test_the_compressed_result_is_written_into_the_message(world):
    """Views of the message see the result: the DDP hook and ``step()`` read it through them (one rank too)."""
    comm = Communicator(None) if world == 1 else Communicator._loopback(world, threaded=False)
    keep = torch.ones(21, dtype=torch.bool)
    keep[3] = False
    layout = ChunkLayout.from_mask(21, world, keep)
    buf = torch.zeros(layout.padded)
    buf[:21] = torch.randn(21, generator=torch.Generator().manual_seed(0))
    view = buf[:21]
    we, se = torch.zeros(layout.padded), torch.zeros(layout.chunk)
    result = comm.compressed_allreduce(buf, we, se, layout)
    assert result.data_ptr() == buf.data_ptr()
    assert torch.equal(view, result[:21]) and view[3] == 0.0  # masked: zero in the result, seen in the view
    comm.close()
