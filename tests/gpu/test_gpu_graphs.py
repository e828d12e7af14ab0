"""CUDA graphs of the allreduce jobs (hf_zeroone._graphs): the same bits as the operations run one by one."""

import pytest
import torch

from hf_zeroone._graphs import _Recording
from hf_zeroone.comm import Communicator
from hf_zeroone.compression import ChunkLayout

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible here"),
    pytest.mark.filterwarnings("error::RuntimeWarning"),  # a recording that failed fails the test
]

CUDA = torch.device("cuda", 0)


def _pair(world: int, rank: int, threaded: bool) -> tuple[Communicator, Communicator]:
    graphed, eager = Communicator._loopback(world, rank, threaded), Communicator._loopback(world, rank, threaded)
    eager._graphs = None
    assert graphed._graphs is not None, "graphs are on by default"
    return graphed, eager


def _inputs(n: int, calls: int, nan_at: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, generator=g).to(CUDA) for _ in range(calls)]
    if nan_at is not None:
        xs[nan_at][5] = float("nan")
    return xs


def _recordings(comm: Communicator) -> list[_Recording]:
    return [e.recording for e in comm._graphs._calls.values() if e.recording is not None]


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("world, masked", [(2, False), (8, True)])
def test_replayed_compressed_allreduces_give_the_bits_of_eager_ones(threaded, world, masked):
    n = 250_003
    keep = torch.arange(n) % 7 != 0 if masked else None
    layout = ChunkLayout.from_mask(n, world, keep, CUDA, segment_starts=[999, 40_000, 40_512, 100_000])
    graphed, eager = _pair(world, world - 1, threaded)
    errors = {c: (torch.zeros(layout.padded, device=CUDA), torch.zeros(layout.chunk, device=CUDA)) for c in (0, 1)}
    lanes = _inputs(37, 6)
    for i, x in enumerate(_inputs(layout.padded, 6, nan_at=3)):  # call 3 is bad on this rank: no error update
        results = []
        for c, comm in enumerate((graphed, eager)):
            lane = lanes[i].clone()
            out = comm.compressed_allreduce(x.clone(), *errors[c], layout, exact=lane)
            results.append((out.clone(), lane, *(e.clone() for e in errors[c])))
        torch.cuda.synchronize()
        for a, b in zip(*results):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"call {i}"
    (recording,) = _recordings(graphed)
    kinds = ["graph" if isinstance(s, torch.cuda.CUDAGraph) else s[0] for s in recording.steps]
    assert kinds == ["graph", "all_to_all", "graph", "all_gather", "graph"]
    for comm in (graphed, eager):
        comm.close()


def test_replayed_float8_allreduces_give_the_bits_of_eager_ones():
    sizes = [1000, 3, 70_000, 129]
    graphed, eager = _pair(4, 1, threaded=True)
    for x in _inputs(sum(sizes), 4, nan_at=2):
        a = graphed.float8_allreduce_async(x.clone(), sizes, exact=x[:11].clone()).wait()
        b = eager.float8_allreduce_async(x.clone(), sizes, exact=x[:11].clone()).wait()
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert len(_recordings(graphed)) == 1
    n = sum(sizes)
    for shape in [(n,), (n,), (n // 2, 2)] * 2:  # the same sizes in a tensor of another shape: a key of its own
        x = torch.randn(n, device=CUDA).view(shape)
        a = graphed.float8_allreduce_async(x.clone(), sizes).wait()
        assert torch.equal(a, eager.float8_allreduce_async(x.clone(), sizes).wait()) and a.shape == shape
    assert len(_recordings(graphed)) == 3
    graphed.close()
    eager.close()


def test_a_new_layout_or_new_error_buffers_are_recorded_anew():
    layouts = [ChunkLayout.from_mask(n, 2, None, CUDA, segment_starts=[100]) for n in (10_000, 20_000)]
    graphed, eager = _pair(2, 0, threaded=False)
    errors = {(c, j): (torch.zeros(lay.padded, device=CUDA), torch.zeros(lay.chunk, device=CUDA))
              for c in (0, 1) for j, lay in enumerate(layouts)}  # fmt: skip
    for step in range(4):
        if step == 2:  # layout 0's error buffers move to new memory, with their values
            for c in (0, 1):
                errors[c, 0] = tuple(e.clone() for e in errors[c, 0])
        for j, layout in enumerate(layouts):
            x = torch.randn(layout.padded, device=CUDA)
            a = graphed.compressed_allreduce(x.clone(), *errors[0, j], layout)
            b = eager.compressed_allreduce(x.clone(), *errors[1, j], layout)
            assert torch.equal(a, b)
            assert all(torch.equal(u, v) for u, v in zip(errors[0, j], errors[1, j]))
    recordings = _recordings(graphed)
    assert len(recordings) == 3  # layout 1, and layout 0 before and after the move
    # layout 1's call was larger than layout 0's: a new input memory, which layout 0's later recording shares
    sizes = sorted((r.inputs[0].numel(), r.inputs[0].data_ptr()) for r in recordings)
    assert [n for n, _ in sizes] == [layouts[0].padded, layouts[0].padded, layouts[1].padded]
    assert len({ptr for _, ptr in sizes}) == 2 and sizes[2][1] in (sizes[0][1], sizes[1][1])


def test_a_rebuilt_layout_of_the_same_buffers_replaces_the_recording():
    n = 50_000
    layouts = [
        ChunkLayout.from_mask(n, 2, None, CUDA, segment_starts=[100]),
        ChunkLayout.from_mask(n, 2, torch.arange(n) % 3 != 0, CUDA, segment_starts=[100]),  # rows left a mask
    ]
    graphed, eager = _pair(2, 1, threaded=False)
    errors = [(torch.zeros(layouts[0].padded, device=CUDA), torch.zeros(layouts[0].chunk, device=CUDA)) for _ in "ab"]
    for step in range(6):
        layout = layouts[step >= 3]
        x = torch.randn(layout.padded, device=CUDA)
        a = graphed.compressed_allreduce(x.clone(), *errors[0], layout)
        b = eager.compressed_allreduce(x.clone(), *errors[1], layout)
        assert torch.equal(a, b) and all(torch.equal(u, v) for u, v in zip(*errors))
    (entry,) = graphed._graphs._calls.values()
    assert entry.of[0] is layouts[1] and entry.recording is not None


def test_without_graphs_the_jobs_run_as_they_are(monkeypatch):
    monkeypatch.setenv("HF_ZEROONE_CUDA_GRAPHS", "0")
    comm = Communicator._loopback(2, 0, threaded=False)
    assert comm._graphs is None
