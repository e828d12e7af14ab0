"""A ``torch.amp.GradScaler`` on several ranks when ``step()`` communicates (no hf_zeroone DDP hook).

A GradScaler looks at each rank's *local* gradients and, on an overflow, skips ``optimizer.step()``
on that rank alone. That is harmless where the gradients were combined before it looked (DDP's
allreduce; our DDP hook, which agrees on overflow, :func:`hf_zeroone.ddp_hook._agreed_local`). When
``step()`` itself communicates, the ranks whose scaler found nothing would send to a rank that never
comes (a compressed step: its collectives pair with that rank's next step's), and on 0/1 Adam's
local steps nothing is exchanged at all, so the skipping rank's step counter falls one behind and
every later sync pairs iterations apart, with no error.

So there the optimizer takes the scaler's side of GradScaler's protocol for optimizers that handle
the scale themselves (``_step_supports_amp_scaling``, as ``torch.optim.Adam(fused=True)``): the
scaler then calls ``step()`` on every rank, overflow or not, with two attributes set, ``grad_scale``
(the scale, or ``None`` once the user called ``scaler.unscale_``) and ``found_inf`` (this rank's
overflow, a float tensor). ``step()`` unscales the gradients as ``scaler.unscale_`` would (the same
operation, the same bits, :func:`unscale_gradients`), and the ranks agree on the skip:

* on a step that exchanges in ``step()``, an overflowing rank sends NaN (:func:`mark_non_finite`:
  an overflow may be a plain ``inf``, which clipping to the variance would bound), the combined
  values are then non-finite on every rank, and every rank skips on them (as without a scaler,
  without the warning);
* on a local step (and 0/1 Adam's sync, whose gradient part is local), one 4-byte allreduce of
  ``found_inf`` (:func:`agreed_overflow`), and every rank skips if any rank overflowed.

A skipped step changes no state. Each rank's scaler still backs off from its own overflow only:
the ranks' loss scales may differ for a while (powers of two: the unscaled gradients do not).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["agreed_overflow", "mark_non_finite", "scaler_found_inf", "unscale_gradients"]


def scaler_found_inf(opt: object) -> Tensor | None:
    """This rank's overflow flag while a GradScaler calls ``step()`` through its protocol, else ``None``."""
    found = getattr(opt, "found_inf", None)
    return found if isinstance(found, Tensor) else None


def unscale_gradients(params: Iterable[Tensor], grad_scale: Tensor | None) -> None:
    """Divide every gradient by ``grad_scale`` in place, as ``GradScaler.unscale_`` would (same op, same bits).

    ``None``: already unscaled (the user called ``scaler.unscale_``, e.g. to clip), nothing to do.
    """
    params = list(params)
    if any(p.grad is not None and p.grad.dtype == torch.float16 for p in params):
        raise ValueError(
            "GradScaler cannot unscale fp16 gradients (parameters in fp16, e.g. model.half()): keep the "
            "parameters in fp32 under torch.autocast, or use bf16 parameters without a GradScaler"
        )
    if grad_scale is None:
        return
    inv_scale = grad_scale.double().reciprocal().float()  # as GradScaler computes it
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_device_dtype[(p.grad.device, p.grad.dtype)].append(p.grad)
    for (device, _), grads in by_device_dtype.items():
        ignored = torch.zeros((), dtype=torch.float32, device=device)  # the scaler already has found_inf
        torch._amp_foreach_non_finite_check_and_unscale_(grads, ignored, inv_scale.to(device))


def agreed_overflow(found_inf: Tensor, allreduce_mean) -> bool:  # noqa: ANN001
    """Whether any rank's scaler found an overflow: one 4-byte allreduce and one host read."""
    flag = found_inf.detach().to(torch.float32).reshape(1).clone()
    return bool(allreduce_mean(flag)[0] > 0)


def mark_non_finite(params: Iterable[Tensor]) -> None:
    """Fill every gradient with NaN: an overflow that the exchange carries to every rank.

    An overflow can be a plain ``inf``, which clipping to the variance bounds to a finite value;
    NaN survives clipping and the compressed allreduce (its scales go NaN on every rank).
    """
    for p in params:
        if p.grad is not None:
            p.grad.fill_(float("nan"))
