"""What an optimizer holds in memory: bytes of tensor storage per role, and the documented figures.

:func:`state_bytes` walks everything an optimizer keeps between steps (per-parameter state,
parameter-group tensors, and for the compressed optimizers their flat communication buffers and
layouts) and adds up the bytes of every distinct storage once, under the name of the first role
that refers to it. A per-parameter entry that is a view into a flat buffer is counted at the size
of the whole buffer (what is really allocated), and a buffer that no state entry refers to any
more still counts under the name it has in the cache. Transient tensors of a step (messages,
decompressed results, scratch inside a collective) are not held between steps and not counted.

:data:`DOCUMENTED_BYTES_PER_PARAM` gives, per optimizer and phase, the bytes per parameter held
beyond the model and its gradients, for fp32 parameters, no masked elements and ``P`` ranks; the
README's "Memory" table and ``tests/test_memory.py`` use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["DOCUMENTED_BYTES_PER_PARAM", "bytes_per_parameter", "documented_bytes_per_param", "state_bytes"]

#: bytes per parameter beyond the model and its gradients, fp32 parameters, no masked elements,
#: as functions of the world size ``P`` (padding to whole bytes per chunk not included)
DOCUMENTED_BYTES_PER_PARAM: dict[str, dict[str, Callable[[int], float]]] = {
    "AdamW": {"all phases": lambda P: 8.0},
    "OneBitAdam": {
        "warm-up (exact)": lambda P: 8.0,
        "compression (1-bit momentum)": lambda P: 12.0 + 4.0 / P if P > 1 else 8.0,
    },
    "ZeroOneAdam": {
        "phase 1, exact steps only": lambda P: 8.0,
        "phase 1 (1-bit gradients)": lambda P: 12.0 + 4.0 / P if P > 1 else 8.0,
        "phase 2 (local steps, 1-bit syncs)": lambda P: 16.0 + 4.0 / P if P > 1 else 12.0,
    },
}


def documented_bytes_per_param(optimizer: str, phase: str, world_size: int) -> float:
    """The documented bytes per parameter of ``optimizer`` (class name) in ``phase`` on ``world_size`` ranks."""
    return DOCUMENTED_BYTES_PER_PARAM[optimizer][phase](world_size)


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name))


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of tensor storage ``optimizer`` holds, by role; each distinct storage counted once.

    Roles are per-parameter state names (``exp_avg``, ``worker_error``, ...), ``group.<key>`` for
    tensors in parameter groups (e.g. a user's ``exp_avg_mask``) and ``flat.<field>`` for what the
    flat-buffer cache of a compressed optimizer holds besides state (e.g. a layout's mask).
    """
    # the model's own parameters (referred to by groups and the flat-buffer cache) are not counted
    seen: set[tuple[str, int]] = {
        (str(p.device), p.untyped_storage().data_ptr()) for g in optimizer.param_groups for p in g["params"]
    }
    out: dict[str, int] = {}

    def add(role: str, t: Tensor) -> None:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            return
        seen.add(key)
        out[role] = out.get(role, 0) + storage.nbytes()

    for state in optimizer.state.values():
        for name, value in state.items():
            for t in _tensors(value):
                add(name, t)
    for group in optimizer.param_groups:
        for name, value in group.items():
            if name != "params":
                for t in _tensors(value):
                    add(f"group.{name}", t)
    cache = getattr(optimizer, "flat_cache", None)
    for entry in cache.entries.values() if cache is not None else ():
        for f in dataclasses.fields(entry):
            for t in _tensors(getattr(entry, f.name)):
                add(f"flat.{f.name}", t)
    views = getattr(optimizer, "variance_views", None)
    for t in views.held() if views is not None else ():
        add("variance_views", t)
    messages = getattr(optimizer, "messages", None)
    for noted in (getattr(messages, "proxy_factors", None), getattr(messages, "handed_norms", None)):
        for t in noted.tensors() if noted is not None else ():
            add("norm_proxy", t)
    return out


def bytes_per_parameter(optimizer: torch.optim.Optimizer) -> float:
    """Total of :func:`state_bytes` divided by the number of elements of the trainable parameters."""
    n = sum(p.numel() for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    return sum(state_bytes(optimizer).values()) / max(n, 1)
