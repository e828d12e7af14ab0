"""Small tensor helpers shared by the layers above (no communication, no optimizer state)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """``True`` when no element of any tensor is NaN or infinite.

    One multi-tensor reduction for all tensors and one host read, with no boolean written per
    element as ``torch.isfinite(t).all()`` does. The 2-norms come first (on CPU four times cheaper
    than the largest absolute values): finite norms mean finite elements. A norm can overflow on
    finite elements above about 1e19, so a non-finite one is checked again with the largest
    absolute values, which cannot.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    if bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all()):
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
