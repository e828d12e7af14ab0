"""A communicator's allreduce jobs on a GPU, recorded once as CUDA graphs and replayed.

A compressed allreduce dispatches about 130 small operations per call whatever its size
(:mod:`hf_zeroone._two_stage`); on a GPU dispatching them costs more host time than the GPU needs
to run them. The operations between two collectives depend only on the call's shapes, the
layout and the addresses of the persistent buffers: no device value is read on the host
(``tests/test_device_path.py``). So for each key (the job, the addresses of a bucket's error
buffers, the lengths, the ranks; a bucket whose layout is rebuilt starts again):

1. the first call runs as it is (it also fills the caches that copy from the host, such as the
   segment starts of ``_runs.expanded``, which keeps them, and so their addresses, for good);
2. the second call is recorded. The job runs with :class:`_Recorder` in place of the
   collectives: each collective ends the graph being recorded, is noted with its tensors, and
   starts the next graph. A call is recorded as graph, collective, graph, collective, graph.
   Nothing runs while it is recorded.
3. That call and every later one copy their own tensors (the message, the exact lane) into the
   recorded inputs, replay the graphs with the real collectives between them, and copy the
   results back: three graph launches and two collectives instead of about 130 operations.

The replay does what the job does, in the same order, so the results have the same bits
(``tests/gpu/test_gpu_graphs.py``). The graphs of one communicator share one memory pool: the
scratch of one call is reused by the next, and a communicator runs its jobs one at a time. A
recording that fails (an operation the graph cannot hold) leaves the communicator's jobs to run
as they are, with a warning. Memory kept: the recorded collectives' buffers (about half a byte per element of a 1-bit
call), one call's scratch, and one copy of the largest call's tensors. ``HF_ZEROONE_CUDA_GRAPHS=0``
turns the recording off.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

__all__ = ["GraphedJobs", "graphs_enabled"]

#: keys kept per communicator: one per DDP bucket (25 MB each by default, so 4096 of them cover a
#: 100 GB model), and the first iteration's buckets until they age out
KEEP = 4096
_ALIGN = 256  # bytes: where each of a call's tensors starts in the shared input memory


def graphs_enabled() -> bool:
    """Whether CUDA tensors' allreduce jobs are recorded as graphs (``HF_ZEROONE_CUDA_GRAPHS``, default on)."""
    return os.environ.get("HF_ZEROONE_CUDA_GRAPHS", "1").strip().lower() not in ("0", "false", "no", "off")


class _Recording:
    """A recorded call: its input copies, and its steps (graphs, and collectives with their tensors)."""

    def __init__(self, inputs: tuple[Tensor, ...]) -> None:
        self.inputs = inputs
        self.steps: list[torch.cuda.CUDAGraph | tuple[str, tuple[Any, ...]]] = []
        self.result = 0  # which input holds the job's result


class _Entry:
    """What a key has: the objects its call used (``of``), and its recording once made."""

    def __init__(self, of: tuple[Any, ...]) -> None:
        self.of = of
        self.recording: _Recording | None = None

    def serves(self, of: tuple[Any, ...]) -> bool:
        return len(of) == len(self.of) and all(a is b for a, b in zip(of, self.of))


class _Recorder:
    """The collectives of a call being recorded: each ends the current graph, is noted, and starts the next."""

    def __init__(self, recording: _Recording, pool: Any) -> None:  # noqa: ANN401 - a graph pool handle
        self.recording, self.pool = recording, pool
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.graph = graph  # only once recording: a failed begin leaves nothing to end

    def end(self) -> None:
        assert self.graph is not None
        graph, self.graph = self.graph, None
        graph.capture_end()
        self.recording.steps.append(graph)

    def _collective(self, name: str, *args: Any) -> None:  # noqa: ANN401 - the collective's arguments
        self.end()
        self.recording.steps.append((name, args))
        self.begin()

    def all_to_all(self, out: Tensor, inp: Tensor) -> None:
        self._collective("all_to_all", out, inp)

    def all_gather(self, outs: list[Tensor], inp: Tensor) -> None:
        self._collective("all_gather", outs, inp)


class GraphedJobs:
    """Runs a communicator's allreduce jobs on CUDA tensors as recorded graphs (module docstring)."""

    def __init__(self) -> None:
        self._calls: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._anchors: dict[torch.device, torch.cuda.CUDAGraph] = {}
        self.off = False  # set when a recording failed: every job runs as it is from then on
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._arenas: dict[torch.device, Tensor] = {}

    def run(
        self,
        key: Hashable,
        job: Callable[..., Tensor],
        coll: Any,  # noqa: ANN401 - the collectives (see hf_zeroone._executor)
        tensors: tuple[Tensor, ...],
        of: tuple[Any, ...] = (),
    ) -> Tensor:
        """``job(coll, *tensors)``, which must return one of ``tensors`` (changed in place).

        ``tensors``: the call's own tensors, copied into the recording and back. ``key`` must name
        everything else the job reads: its shapes and the addresses of its buffers. ``of``: objects
        the job reads that the key does not name (a bucket's layout, rebuilt when its mask
        changes): a call with other objects replaces the key's recording.
        """
        if self.off:
            return job(coll, *tensors)
        entry = self._calls.get(key)
        if entry is None or not entry.serves(of):
            self._remember(key, _Entry(of))
            return job(coll, *tensors)
        if entry.recording is None:
            try:
                entry.recording = self._record(job, tensors)
            except Exception as exc:  # noqa: BLE001 - any failure to record: run as it is
                self.off = True
                self._calls.clear()
                warnings.warn(
                    f"hf_zeroone: recording a communication job as a CUDA graph failed ({type(exc).__name__}: "
                    f"{exc}); this communicator's jobs run without graphs from now on",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return job(coll, *tensors)
        state = entry.recording
        self._calls.move_to_end(key)
        for mine, theirs in zip(state.inputs, tensors):
            mine.copy_(theirs)
        for step in state.steps:
            if isinstance(step, tuple):
                getattr(coll, step[0])(*step[1])
            else:
                step.replay()
        for mine, theirs in zip(state.inputs, tensors):
            theirs.copy_(mine)
        return tensors[state.result]

    def _pool(self, device: torch.device) -> Any:  # noqa: ANN401 - a graph pool handle
        """The memory pool of ``device``'s recordings, held by a graph of its own.

        A pool whose graphs are all gone is freed, and torch refuses to record into it again; a
        bucket's recording is dropped when its layout is rebuilt, so the pool keeps a graph of
        its own (one tiny fill) for as long as the communicator lives. Called on the side stream.
        """
        anchor = self._anchors.get(device)
        if anchor is None:
            anchor = torch.cuda.CUDAGraph()
            anchor.capture_begin(capture_error_mode="thread_local")
            try:
                torch.zeros(1, device=device)
            finally:
                anchor.capture_end()
            self._anchors[device] = anchor
        return anchor.pool()

    def _remember(self, key: Hashable, entry: _Entry) -> None:
        self._calls.pop(key, None)
        self._calls[key] = entry
        while len(self._calls) > KEEP:
            self._calls.popitem(last=False)

    def _inputs(self, tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """Where a recording reads its call's tensors: one memory for all recordings that fit in it.

        A call copies its tensors in and its results out before the next call starts, so the
        recordings of one communicator can share it: a bucket costs no memory of its own for its
        message. A call larger than any before gets a new memory (the old one stays with the
        recordings that use it).
        """
        device = tensors[0].device
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        arena = self._arenas.get(device)
        if arena is None or arena.numel() < end:
            arena = self._arenas[device] = torch.empty(end, dtype=torch.uint8, device=device)
        return tuple(
            arena[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, tensors)
        )

    def _record(self, job: Callable[..., Tensor], tensors: tuple[Tensor, ...]) -> _Recording:
        """Record ``job`` on the recording's own inputs (see :meth:`_inputs`); nothing runs."""
        device = tensors[0].device
        recording = _Recording(self._inputs(tensors))
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))  # the inputs' allocation comes first
        with torch.cuda.stream(side):
            recorder = _Recorder(recording, self._pool(device))
            recorder.begin()
            try:
                result = job(recorder, *recording.inputs)
            finally:
                if recorder.graph is not None:
                    recorder.end()
        torch.cuda.current_stream(device).wait_stream(side)
        found = [i for i, t in enumerate(recording.inputs) if _same_tensor(t, result)]
        if not found:
            raise RuntimeError("the job returned a tensor that is none of its inputs")
        recording.result = found[0]
        return recording


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
