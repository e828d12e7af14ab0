"""Per-parameter scalars kept as vectors: one operation for all, no 0-dim tensor per parameter.

``follow_gradient_scale`` keeps a few float32 numbers per parameter (:mod:`._grad_scale`). As 0-dim
tensors of their own, every update would be a multi-tensor call over hundreds of 0-dim tensors, and
every use a ``torch.stack`` of them, a noticeable part of a step on a model of many tensors. Here
the entries ``state[key]`` of one list of states are the elements of one vector (views from
``unbind``), so an update is one operation on the vector and every entry follows it.

:class:`Noted` does the same for the numbers one step hands from the bucket that computed them to
``step()`` (norm-proxy factors, clipping fractions, scale samples): one vector per bucket, gathered
for whatever list of parameters asks.

A checkpoint still saves and loads one 0-dim float32 tensor per parameter and entry. Whatever
replaces an entry (a loaded checkpoint, a user) is noticed on the next use, which stacks the
entries into a new vector; nothing is cached outside the state itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hf_zeroone._tensors import joined, moved, picked

__all__ = ["Noted", "adopt", "as_vector", "read_vector"]


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


class Noted:
    """Per-parameter numbers noted for lists of parameters, one vector per list, gathered for any list.

    A bucket notes its vector at once (:meth:`note`); a reader asks for its own list of parameters
    (:meth:`gather`): one concatenation and one gather, not a 0-dim tensor per parameter. A later
    note of a parameter wins over an earlier one, and noting the same list again replaces it.
    """

    def __init__(self) -> None:
        self.lists: list[tuple[tuple[int, ...], Tensor]] = []

    def note(self, params: Sequence[Tensor], values: Tensor) -> None:
        """Note ``values`` (a vector, one entry per parameter, in order) for ``params``."""
        key = tuple(map(id, params))
        self.lists = [entry for entry in self.lists if entry[0] != key]
        self.lists.append((key, values))

    def __bool__(self) -> bool:
        return bool(self.lists)

    def gather(self, params: Sequence[Tensor]) -> tuple[list[int], Tensor | None]:
        """The positions in ``params`` of the parameters with a value, and their values as one vector."""
        if not self.lists:
            return [], None
        ids = list(map(id, params))
        if len(self.lists) == 1 and self.lists[0][0] == tuple(ids):
            return list(range(len(ids))), self.lists[0][1]
        where, base = {}, 0
        for key, _ in self.lists:
            where.update(zip(key, range(base, base + len(key))))
            base += len(key)
        positions = [i for i, k in enumerate(ids) if k in where]
        if not positions:
            return [], None
        first = self.lists[0][1]
        values = first if len(self.lists) == 1 else torch.cat([moved(v, first.device) for _, v in self.lists])
        return positions, picked(values, [where[ids[i]] for i in positions])

    def clear(self) -> None:
        self.lists.clear()

    def tensors(self) -> list[Tensor]:
        """Every vector held (for :func:`._memory.state_bytes`)."""
        return [v for _, v in self.lists]
