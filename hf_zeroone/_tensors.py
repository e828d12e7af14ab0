"""Small tensor helpers shared by the layers above (no communication, no optimizer state)."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from itertools import repeat

import numpy as np
import torch
from torch import Tensor

from hf_zeroone._runs import apply_to_pieces, pieces


def scalar_operand(tensors: Sequence[Tensor], value: float) -> float | Tensor:
    """``value`` as a CPU multi-tensor op over ``tensors`` takes it fastest, with the same bits: a 0-dim
    tensor made once for float32 and float64 lists (the op would wrap the number per tensor)."""
    if not tensors or tensors[0].device.type != "cpu":
        return value
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.float64) or any(t.dtype != dtype for t in tensors):
        return value
    return torch.full((), value, dtype=dtype)  # one call (torch.tensor makes four)


def by_value(numbers: Iterable[float]) -> dict[float, list[int]]:
    """The positions of each distinct host number, in first-seen order (per-tensor numbers are mostly one per group)."""
    out: dict[float, list[int]] = {}
    for i, value in enumerate(numbers):
        out.setdefault(value, []).append(i)
    return out


def moved(t: Tensor, device: torch.device | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """``t.to(device=device, dtype=dtype)``, or ``t`` itself where it has both (a ``.to`` that copies nothing
    is still a dispatched call)."""
    if (device is None or t.device == torch.device(device)) and (dtype is None or t.dtype == dtype):
        return t
    return t.to(device=device, dtype=dtype)


def _scalar_op(op: str, tensors: Sequence[Tensor], value: float, in_place: bool) -> list[Tensor]:
    """``t <op> value`` for every tensor (``op``: ``"mul"``, ``"div"`` or ``"add"``), in place or as new tensors.

    One operation on the vector they tile, in order or reversed (:func:`tiling`; new tensors are
    then pieces of one), else one multi-tensor call (see :func:`scalar_operand`).
    """
    tensors = list(tensors)
    span, reverse = tiling(tensors) if tensors else (None, False)
    if span is not None:
        if in_place:
            getattr(span, f"{op}_")(scalar_operand([span], value))
            return tensors
        return pieces(getattr(span, op)(scalar_operand([span], value)), tensors, reverse)
    operand = scalar_operand(tensors, value)
    if op == "add" and isinstance(operand, Tensor):  # torch's overload taking one 0-dim tensor is slower on CPU
        operand = [operand] * len(tensors)
    done = getattr(torch, f"_foreach_{op}_" if in_place else f"_foreach_{op}")(tensors, operand)
    return tensors if in_place else list(done)


def mul_scalar(tensors: Sequence[Tensor], value: float) -> list[Tensor]:
    return _scalar_op("mul", tensors, value, False)


def mul_scalar_(tensors: Sequence[Tensor], value: float) -> None:
    _scalar_op("mul", tensors, value, True)


def div_scalar(tensors: Sequence[Tensor], value: float) -> list[Tensor]:
    return _scalar_op("div", tensors, value, False)


def div_scalar_(tensors: Sequence[Tensor], value: float) -> None:
    _scalar_op("div", tensors, value, True)


def add_scalar_(tensors: Sequence[Tensor], value: float) -> None:
    _scalar_op("add", tensors, value, True)


def zeros_like_flat(like: Sequence[Tensor]) -> list[Tensor]:
    """Zeros shaped like each tensor: pieces of one flat tensor per dtype and device for the contiguous ones.

    State kept that way (an optimizer's ``m`` and ``v``) tiles one vector, so an operation on all
    of it is one operation (:func:`flat_span`); other layouts get ``zeros_like`` each.
    """
    out = [None if t.is_contiguous() else torch.zeros_like(t, memory_format=torch.preserve_format) for t in like]
    for dtype, device in dict.fromkeys((t.dtype, t.device) for t, o in zip(like, out) if o is None):
        index = [i for i, t in enumerate(like) if out[i] is None and t.dtype == dtype and t.device == device]
        flat = torch.zeros(sum(like[i].numel() for i in index), dtype=dtype, device=device)
        for i, piece in zip(index, pieces(flat, [like[i] for i in index], False)):
            out[i] = piece
    return out  # type: ignore[return-value]


def float32_norms(tensors: Sequence[Tensor]) -> Tensor:
    """The 2-norm of each tensor as one float32 vector: ``torch.linalg.vector_norm(t, dtype=torch.float32)`` each.

    The float32 tensors go through one ``torch._foreach_norm`` (the same bits), the others one at a
    time, cast as they are reduced. Per-tensor statistics then stay one vector: one call each.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    norms: list[Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    plain = [i for i, t in enumerate(tensors) if t.dtype == torch.float32]
    for i, norm in zip(plain, torch._foreach_norm([tensors[i] for i in plain]) if plain else []):
        norms[i] = norm
    for i, t in enumerate(tensors):
        if norms[i] is None:
            norms[i] = torch.linalg.vector_norm(t, dtype=torch.float32)
    return torch.stack(norms)


def all_finite(tensors: Iterable[Tensor], norms: Tensor | None = None) -> bool:
    """``True`` when no element of any tensor is NaN or infinite.

    One multi-tensor reduction and one host read, no boolean per element. Finite 2-norms mean finite
    elements; a norm can overflow on finite elements above about 1e19, so a non-finite one is
    checked again with the largest absolute values, which cannot. ``norms``: the tensors' norms, if taken.
    """
    if norms is not None and bool(torch.isfinite(norms).all()):
        return True
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    tensors = [span] if (span := flat_span(tensors)) is not None else tensors  # one message's pieces: one reduction
    if bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all()):
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors, math.inf))).all())


#: elements of one stacked group of :func:`shape_groups` at most (16 MB of float32, transient)
GROUP_ELEMENTS = 1 << 22


def shape_groups(tensors: Sequence[Tensor], indices: Iterable[int]) -> list[list[int]]:
    """``indices`` split by the shape, dtype and device of their tensors, in first-seen order.

    Same-shaped tensors (a layer's weights, repeated in every layer) stack into one tensor, so an
    operation with a different 0-dim operand per tensor runs as one broadcast call per shape (a
    multi-tensor call takes such operands tensor by tensor). A group holds at most
    :data:`GROUP_ELEMENTS` elements (or one tensor, if larger): bounded memory.
    """
    groups: dict[tuple, list[list[int]]] = {}
    for i in indices:
        t = tensors[i]
        chunks = groups.setdefault((t.shape, t.dtype, t.device), [[]])
        if chunks[-1] and (len(chunks[-1]) + 1) * t.numel() > GROUP_ELEMENTS:
            chunks.append([])
        chunks[-1].append(i)
    return [chunk for chunks in groups.values() for chunk in chunks]


def host_index(indices: Sequence[int], device: torch.device) -> Tensor:
    """An int64 index tensor of host integers on ``device``, copied without waiting for the device's stream."""
    return torch.tensor(indices, dtype=torch.int64).to(device, non_blocking=True)


def picked(values: Tensor, index: Sequence[int]) -> Tensor:
    """``values[index]`` for host integers ``index``: ``values`` itself where ``index`` is ``0 .. n - 1``, one
    ``flip`` where it is ``n - 1 .. 0`` (a DDP bucket's order against its parameters')."""
    index, n = list(index), values.numel()
    if index == list(range(n)):
        return values
    if index == list(range(n - 1, -1, -1)):
        return values.flip(0)
    return values.index_select(0, host_index(index, values.device))


def rows_by_group(values: Tensor, groups: Sequence[Sequence[int]]) -> list[Tensor]:
    """The entries of a per-tensor vector for each group of :func:`shape_groups` (of all or some tensors).

    One gather (none where the groups are in order) and one split, not a 0-dim tensor per entry.
    """
    order = [i for group in groups for i in group]
    if len(groups) == 1 and order == list(range(values.numel())):
        return [values]
    if not order:
        return []
    if order != list(range(values.numel())):
        values = values.index_select(0, host_index(order, values.device))
    return list(values.split([len(group) for group in groups]))


def in_order(parts: Sequence[tuple[Sequence[int], Tensor]], n: int) -> Tensor:
    """One vector of ``n`` values from ``(indices, values)`` parts (vectors) that cover ``0 .. n - 1`` once.

    Per-tensor statistics computed one shape group at a time (:func:`shape_groups`) come back as
    one vector per group; joined here by one concatenation and, where the groups interleave, one
    indexed copy, not a 0-dim tensor per element.
    """
    order = [i for indices, _ in parts for i in indices]
    values = parts[0][1] if len(parts) == 1 else torch.cat([v for _, v in parts])
    if order == list(range(n)):
        return values
    out = torch.empty_like(values)
    return out.index_copy_(0, host_index(order, values.device), values)


_base_of, _dtype_of, _shape_of = map(operator.attrgetter, ("_base", "dtype", "shape"))


def flat_span(tensors: Sequence[Tensor]) -> Tensor | None:
    """The one-dimensional stretch of memory that ``tensors`` tile, in order, or ``None`` where they do not.

    Pieces of a message or a DDP bucket (:func:`hf_zeroone.optim._flat.layout_views`): an operation
    on each is one operation on the span.
    """
    first = tensors[0] if tensors else None
    base = None if first is None else first._base
    if base is None or not base.is_contiguous() or not all(map(operator.is_, map(_base_of, tensors), repeat(base))):
        return None
    if not all(map(Tensor.is_contiguous, tensors)) or not all(
        map(operator.eq, map(_dtype_of, tensors), repeat(base.dtype))
    ):
        return None
    offsets = np.fromiter(map(Tensor.storage_offset, tensors), np.int64, len(tensors))
    ends = offsets + np.fromiter(map(Tensor.numel, tensors), np.int64, len(tensors))
    if not np.array_equal(offsets[1:], ends[:-1]):
        return None
    return base.view(-1).narrow(0, int(offsets[0]) - base.storage_offset(), int(ends[-1] - offsets[0]))


def tiling(tensors: list[Tensor]) -> tuple[Tensor | None, bool]:
    """:func:`flat_span` of ``tensors`` or, ``True`` second, of them reversed (a DDP bucket's order)."""
    if len(tensors) > 1 and tensors[0].storage_offset() > tensors[-1].storage_offset():
        span = flat_span(tensors[::-1])
        return span, span is not None
    return flat_span(tensors), False


def apply_per_tensor(
    op: str, tensors: Sequence[Tensor], operands: Tensor | Sequence[Tensor] | Sequence[float], in_place: bool
) -> list[Tensor]:
    """``t * f`` or ``t / f`` (``op``: ``"mul"`` or ``"div"``) for each tensor and its operand.

    In place (returns ``tensors``) or as new tensors. Host numbers go in one multi-tensor call per
    distinct number;
    tensor operands (0-dim tensors, or one vector), which such a call takes tensor by tensor, in
    broadcast calls: on tensors that tile one vector in order or in reverse (:func:`flat_span`), per
    run of same-sized tensors (:func:`runs`) or on the vector with the operands repeated (new
    tensors are pieces of a copy of the vector); otherwise on same-shaped tensors stacked
    (:func:`shape_groups`). Tensor operands must be float32 or of their tensor's dtype.
    """
    tensors = list(tensors)
    if not tensors:
        return tensors
    if not isinstance(operands, Tensor) and not isinstance(operands[0], Tensor):  # one call per distinct number
        values = by_value(operands)
        span = flat_span(tensors) if in_place and len(values) == 1 else None
        if span is not None:  # the pieces of one message, one number: one operation on it
            getattr(span, f"{op}_")(scalar_operand([span], operands[0]))
            return tensors
        fn, out = getattr(torch, f"_foreach_{op}_" if in_place else f"_foreach_{op}"), list(tensors)
        for value, index in values.items():
            chosen = [tensors[i] for i in index]
            done = fn(chosen, scalar_operand(chosen, value))
            for i, t in zip(index, chosen if in_place else done):
                out[i] = t
        return out
    vector = operands if isinstance(operands, Tensor) else None
    span, reverse = tiling(tensors)
    if span is not None:
        vector = torch.stack(list(operands)) if vector is None else vector
        vector = vector.flip(0) if reverse else vector
        target, numels = span if in_place else span.clone(), [t.numel() for t in tensors[:: -1 if reverse else 1]]
        apply_to_pieces(op, target, numels, vector)
        if in_place:
            return tensors
        return pieces(target, tensors, reverse)
    out = list(tensors)
    groups = shape_groups(tensors, range(len(tensors)))
    rows = rows_by_group(vector, groups) if vector is not None else [None] * len(groups)
    for group, row in zip(groups, rows):
        if len(group) == 1:  # alone in its shape (or too large to stack): one call, no copy
            i = group[0]
            operand = operands[i] if row is None else row.view(())
            out[i] = getattr(tensors[i], f"{op}_" if in_place else op)(operand)
            continue
        stacked = torch.stack([tensors[i] for i in group])
        ndim = stacked.dim() - 1
        operand = torch.stack([operands[i] for i in group]) if row is None else row
        operand = operand.view(-1, *([1] * ndim))
        getattr(stacked, f"{op}_")(operand)
        if in_place:
            torch._foreach_copy_([tensors[i] for i in group], list(stacked.unbind()))
        else:
            for i, value in zip(group, stacked.unbind()):
                out[i] = value
    return out


def per_tensor_in_dtypes(op: str, tensors: Sequence[Tensor], factors: Tensor, in_place: bool) -> list[Tensor]:
    """:func:`apply_per_tensor` with each float32 factor first rounded to its tensor's dtype.

    One call per dtype among ``tensors`` (one, as a rule), whatever their number.
    """
    tensors = list(tensors)
    dtypes = list(dict.fromkeys(t.dtype for t in tensors))
    if len(dtypes) <= 1:
        return apply_per_tensor(op, tensors, moved(factors, dtype=dtypes[0]) if dtypes else factors, in_place)
    out = list(tensors)
    for dtype in dtypes:
        index = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        done = apply_per_tensor(op, [tensors[i] for i in index], moved(picked(factors, index), dtype=dtype), in_place)
        for i, value in zip(index, done):
            out[i] = value
    return out


def joined(elements: Sequence[Tensor], gather: bool = False) -> Tensor:
    """0-dim tensors as one vector, in order: a view when they are consecutive elements of one, else a stack.

    ``unbind`` of a vector makes such elements; a view shares their memory (writing to it writes
    them). With ``gather``, elements of one vector in another order (a DDP bucket's are in reverse)
    are read by one gather instead of a stack: a copy either way.
    """
    first = elements[0] if elements else None
    base = None if first is None or first.dim() != 0 else first._base
    if base is not None and base.dim() == 1 and base.stride(0) == 1 and base.dtype == first.dtype:
        start, n = elements[0].storage_offset(), len(elements)
        # map() over C methods: much faster than a Python loop over the elements
        if all(map(operator.is_, map(_base_of, elements), repeat(base, n))):
            offsets = list(map(Tensor.storage_offset, elements))
            if offsets == list(range(start, start + n)):
                return base.narrow(0, start - base.storage_offset(), n)
            if gather:
                origin = base.storage_offset()
                if offsets == list(range(start, start - n, -1)):  # reversed: DDP's bucket order
                    return base.narrow(0, start - n + 1 - origin, n).flip(0)
                return base.index_select(0, host_index([o - origin for o in offsets], base.device))
    return torch.stack(list(elements))


def bit_checksum(tensors: list[Tensor], device: torch.device | str | None = None) -> Tensor:
    """Two int64 sums of the tensors' bit patterns (plain and position-weighted): equal iff bit-equal.

    Exact integer sums (wrapping modulo 2^64): the weighted one catches tensors that swapped places.
    Put on ``device`` (default: the first tensor's, the CPU for none).
    """
    home = tensors[0].device if tensors else torch.device("cpu")
    total = torch.zeros(2, dtype=torch.int64, device=home)
    for i, t in enumerate(tensors):
        t = t.detach().contiguous().reshape(-1)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        s = t.view(bits).sum(dtype=torch.int64).to(home)
        total[0] += s
        total[1] += s * (i + 1)
    return total if device is None else total.to(device)
