"""The bookkeeping of hf_zeroone._graphs on the CPU (the graphs themselves: tests/gpu/test_gpu_graphs.py)."""

import pytest
import torch

from hf_zeroone import _graphs, _runs
from hf_zeroone._graphs import GraphedJobs, _Recording, graphs_enabled
from hf_zeroone.comm import Communicator
from hf_zeroone.compression import ChunkLayout


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("off", False), ("False", False)])
def test_the_environment_turns_the_graphs_on_and_off(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("HF_ZEROONE_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("HF_ZEROONE_CUDA_GRAPHS", value)
    assert graphs_enabled() is on
    assert (Communicator._loopback(2, threaded=False)._graphs is not None) is on


def test_cpu_tensors_never_reach_the_graphs():
    comm = Communicator._loopback(2, threaded=False)

    class Refuse(GraphedJobs):
        def run(self, *args, **kwargs):
            raise AssertionError("a CPU job went to the CUDA graphs")

    comm._graphs = Refuse()
    layout = ChunkLayout.from_mask(1000, 2, None)
    out = comm.compressed_allreduce(
        torch.randn(layout.padded), torch.zeros(layout.padded), torch.zeros(layout.chunk), layout
    )
    assert out.shape == (layout.padded,)
    comm.float8_allreduce_async(torch.randn(64), [64]).wait()


class _Replay:
    """A stand-in for a recorded graph: replaying it runs a function."""

    def __init__(self, fn):
        self.replay = fn


def _fake_record(log):
    """A ``_record`` that records ``job`` as: double the input, a collective, add one."""

    def record(self, job, tensors):
        log.append("record")
        rec = _Recording(tuple(t.clone() for t in tensors))
        x = rec.inputs[0]
        rec.steps = [_Replay(lambda: x.mul_(2)), ("all_to_all", (x, x)), _Replay(lambda: x.add_(1))]
        return rec

    return record


class _Coll:
    def __init__(self):
        self.calls = 0

    def all_to_all(self, out, inp):
        self.calls += 1


def test_a_key_runs_as_it_is_once_then_is_recorded_and_replayed_with_its_collectives(monkeypatch):
    log = []
    monkeypatch.setattr(GraphedJobs, "_record", _fake_record(log))
    jobs, coll = GraphedJobs(), _Coll()

    def job(c, x):
        log.append("eager")
        return x.mul_(2).add_(1)

    outs = [jobs.run("k", job, coll, (torch.full((3,), float(i)),)) for i in range(3)]
    assert log == ["eager", "record"]
    assert [o.tolist() for o in outs] == [[1.0] * 3, [3.0] * 3, [5.0] * 3]  # the caller's tensors, changed
    assert coll.calls == 2  # the replays' collectives, in their place


def test_a_recording_that_fails_warns_and_leaves_every_job_to_run_as_it_is(monkeypatch):
    tries = []

    def fail(self, job, tensors):
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedJobs, "_record", fail)
    jobs, ran = GraphedJobs(), []

    def job(c, x):
        ran.append(1)
        return x.add_(1)

    jobs.run("k", job, None, (torch.zeros(2),))
    with pytest.warns(RuntimeWarning, match="jobs run without graphs from now on"):
        assert jobs.run("k", job, None, (torch.zeros(2),)).tolist() == [1.0, 1.0]
    for key in ("k", "k", "other", "other"):  # no second warning, no second try, for any key
        jobs.run(key, job, None, (torch.zeros(2),))
    assert len(ran) == 6 and len(tries) == 1 and jobs.off


def test_only_the_last_keys_are_kept(monkeypatch):
    monkeypatch.setattr(_graphs, "KEEP", 3)
    jobs = GraphedJobs()
    for key in range(5):
        jobs.run(key, lambda c, x: x, None, (torch.zeros(1),))
    assert list(jobs._calls) == [2, 3, 4]


def test_a_call_with_other_objects_replaces_the_keys_recording(monkeypatch):
    log = []
    monkeypatch.setattr(GraphedJobs, "_record", _fake_record(log))
    jobs, coll, old, new = GraphedJobs(), _Coll(), object(), object()

    def job(c, x):
        log.append("eager")
        return x.mul_(2).add_(1)

    for of in (old, old, old, new, new, new):
        jobs.run("k", job, coll, (torch.zeros(1),), of=(of,))
    assert log == ["eager", "record", "eager", "record"]  # a rebuilt layout: as a new key
    assert len(jobs._calls) == 1 and jobs._calls["k"].of[0] is new


def test_the_segment_starts_that_graphs_read_are_never_dropped_from_their_cache():
    """A recorded graph reads the device tensors of ``_runs.SEGMENT_STARTS``: an entry must outlive every graph."""
    scales = torch.ones(3)
    first = (0, 5, 9, 20)
    _runs.expanded(scales, first)
    kept = _runs.SEGMENT_STARTS[first, scales.device]
    for i in range(1, 1500):  # many bucket shapes
        _runs.expanded(scales, (0, 5, 9, 20 + i))
    assert _runs.SEGMENT_STARTS[first, scales.device] is kept
