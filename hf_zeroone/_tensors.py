"""Small tensor helpers shared by the layers above (no communication, no optimizer state)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """``True`` when no element of any tensor is NaN or infinite.

    Any non-finite element makes its tensor's sum non-finite, so a finite sum proves the tensor
    finite; only when some sum is not finite (a NaN/inf, or finite values whose sum overflows)
    are the elements checked one by one. On CPU that is about ten times faster than
    ``torch.isfinite(t).all()``, which writes a boolean per element.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def non_finite_flag(t: Tensor) -> Tensor:
    """``[1.0]`` if ``t`` has a NaN or infinite element, else ``[0.0]``: float32, on ``t``'s device.

    Never read on the host (no GPU sync): ``aminmax`` propagates NaN, and an infinity is the
    minimum or the maximum. One pass that writes nothing per element.
    """
    if t.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=t.device)
    low, high = torch.aminmax(t.detach().reshape(-1))
    return (~(torch.isfinite(low) & torch.isfinite(high))).to(torch.float32).reshape(1)
