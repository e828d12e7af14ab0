"""Small tensor helpers shared by the layers above (no communication, no optimizer state)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """``True`` when no element of any tensor is NaN or infinite.

    The largest absolute value of a tensor is NaN or infinite exactly when an element is (it
    cannot overflow, unlike a sum): one multi-tensor reduction for all tensors, one host read,
    and no boolean written per element as ``torch.isfinite(t).all()`` does.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors, math.inf))).all())


def non_finite_flag(t: Tensor) -> Tensor:
    """``[1.0]`` if ``t`` has a NaN or infinite element, else ``[0.0]``: float32, on ``t``'s device.

    Never read on the host (no GPU sync): ``aminmax`` propagates NaN, and an infinity is the
    minimum or the maximum. One pass that writes nothing per element.
    """
    if t.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=t.device)
    low, high = torch.aminmax(t.detach().reshape(-1))
    return (~(torch.isfinite(low) & torch.isfinite(high))).to(torch.float32).reshape(1)
