"""Per-parameter scalars of the optimizer state kept as views of one vector: one operation for all.

``follow_gradient_scale`` keeps a few float32 numbers per parameter (:mod:`._grad_scale`). As 0-dim
tensors of their own, every update would be a multi-tensor call over hundreds of 0-dim tensors, and
every use a ``torch.stack`` of them, a noticeable part of a step on a model of many tensors. Here
the entries ``state[key]`` of one list of states are the elements of one vector (views from
``unbind``), so an update is one operation on the vector and every entry follows it.

A checkpoint still saves and loads one 0-dim float32 tensor per parameter and entry. Whatever
replaces an entry (a loaded checkpoint, a user) is noticed on the next use, which stacks the
entries into a new vector; nothing is cached outside the state itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from hf_zeroone._tensors import joined

__all__ = ["adopt", "as_vector", "read_vector"]


def as_vector(states: Sequence[dict[str, Any]], key: str) -> Tensor:
    """The entries ``states[i][key]`` (0-dim, all present) as one vector, in order, whose views they are.

    When they already are consecutive elements of one vector, a view of it is returned, and
    writing to it writes the entries. Otherwise they are stacked into a new one, which
    :func:`adopt` makes theirs.
    """
    vector = joined([st[key] for st in states])
    return vector if vector._base is not None else adopt(states, key, vector)


def read_vector(states: Sequence[dict[str, Any]], key: str) -> Tensor:
    """The entries ``states[i][key]`` (0-dim, all present) as one vector to read, in order.

    :func:`as_vector` where they are consecutive; elements of one vector in another order (the same
    parameters in a DDP bucket's order) are gathered, and nothing is adopted: the state's vector
    stays the one the updates write to.
    """
    return joined([st[key] for st in states], gather=True)


def adopt(states: Sequence[dict[str, Any]], key: str, values: Tensor) -> Tensor:
    """Make the 1-D ``values`` (one element per state) the vector of ``states[i][key]``: each entry a view of it."""
    for st, element in zip(states, values.unbind()):
        st[key] = element
    return values
