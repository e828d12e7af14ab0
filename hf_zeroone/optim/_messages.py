"""What each rank sends in a step, and what the combined result becomes: the optimizer's message protocol.

Both communication paths use it: the DDP hook (:mod:`hf_zeroone.ddp_hook`), bucket by bucket
during backward, and ``step()``'s own exchange (:mod:`._exchange`). For every kind of
:mod:`._base`'s table:

1. :meth:`Messages.write`: each parameter's message into a flat buffer's views (compressed
   gradient and momentum messages in units of the update);
2. :meth:`Messages.exact_floats`: the floats that travel exactly beside the message (per-tensor
   squared norms and the samples of ``follow_gradient_scale``);
3. after the collective, :meth:`Messages.from_update_units` and, for 1-bit momentum,
   :meth:`Messages.read_momentum`, which turns the combined momentum into a gradient-sized
   implied gradient; ``step()`` takes it back with :meth:`Messages.undo_norm_proxy`.

The 1-bit kinds ``ONEBIT_GRADIENT`` and ``ONEBIT_MOMENTUM`` send their message divided by
per-element weights derived from ``v`` (the same on every rank) and multiply the combined result
back (:func:`._functional.update_unit_weights`): an element whose variance is far below its
tensor's is compressed in units of its update, so its compression error cannot become a step of
many thousand learning rates. ``ONEBIT_SYNC``'s ``u`` is a parameter displacement, already in
those units.

For ``ONEBIT_MOMENTUM`` the combined momentum ``m'`` is turned into the gradient it implies,
``g = (m' - beta1 * m) / (1 - beta1)``, identical on every rank; ``m <- beta1 * m + (1 - beta1) * g``
then gives back ``m'``. That ``g`` carries the 1-bit compression noise times ``1 / (1 - beta1)``:
its norm can be 10-20 times the true gradient's, and a clipping threshold meant for gradients
would cut every step. So ``g`` is handed on rescaled, per tensor, to the root mean square over
ranks of the local gradients' norms (exact: one float per tensor, averaged alongside); ``step()``
divides the factor out again. Unclipped, the step reproduces ``m'``; clipped by ``s``, the step's
gradient contribution is ``s * g``, so clipping sees a gradient-sized norm and still damps a real
spike. On every other step that communicates, ``p.grad`` after a DDP hook is an averaged gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hf_zeroone.optim import _functional as F
from hf_zeroone.optim import _grad_scale, _local_phase, _masks
from hf_zeroone.optim._grad_scale import kept_fraction
from hf_zeroone.optim._step_kind import StepKind

__all__ = ["Messages"]

#: clipping that keeps less than this fraction of 1-bit Adam's implied gradient is treated as a
#: spike: the error buffers are scaled with it (see Messages.undo_norm_proxy)
_SPIKE_CLIP = 0.1
#: the error-feedback buffers a spike is removed from
_ERROR_BUFFERS = ("worker_error", "server_error")


class Messages:
    """The message protocol of one :class:`~hf_zeroone.optim.CompressedAdamBase` (its ``messages``).

    Reads the optimizer's state and parameter groups; holds only one step's norm-proxy factors
    and clipping fractions.
    """

    def __init__(self, optimizer: Any) -> None:  # noqa: ANN401 - a CompressedAdamBase
        self.opt = optimizer
        #: per parameter, the factor :meth:`read_momentum` applied to this step's implied gradient
        #: and the norm it handed on
        self.norm_proxy_factors: dict[Tensor, tuple[Tensor, Tensor]] = {}
        #: per parameter, the fraction of the handed-on norm that clipping left (see contain_spikes)
        self._clip_fractions: list[tuple[Tensor, Tensor]] = []

    def write(
        self, kind: StepKind, params: Sequence[Tensor], grads: Sequence[Tensor | None], outs: Sequence[Tensor],
        units: bool = True,
    ) -> None:  # fmt: skip
        """Write what this rank sends for each parameter in a ``kind`` step into ``outs`` (fp32, shaped like it).

        Compressed gradient and momentum messages are then put in units of the update
        (:func:`._functional.update_unit_weights`) unless ``units`` is false (one process: nothing
        is compressed). Reads the optimizer state and leaves it unchanged, except for noting which
        masked rows received a gradient: a step that is later skipped (non-finite gradients, a
        GradScaler overflow) leaves no other trace.
        """
        state = self.opt.state
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        if kind in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM):
            for p, g in zip(params, grads):
                _masks.note_activity(state[p], g)
        if kind.message_is_gradient:
            torch._foreach_copy_(list(outs), grads)
        elif kind is StepKind.ONEBIT_SYNC:  # sent after this step's local update
            for p, out in zip(params, outs):
                _local_phase.displacement(p, state[p], out)
        else:  # ONEBIT_MOMENTUM
            for group, ps, items in self.opt.grouped(params, list(zip(grads, outs))):
                gs = [g for g, _ in items]
                if group["weight_decay"] and not group["decoupled_weight_decay"]:
                    gs = F.l2_gradients(gs, ps, group["weight_decay"])
                F.momentum_messages([state[p]["exp_avg"] for p in ps], gs, group["betas"][0], [o for _, o in items])
        if units:
            self._update_units(kind, params, outs, divide=True)

    def from_update_units(self, kind: StepKind, params: Sequence[Tensor], views: Sequence[Tensor]) -> None:
        """Undo the update units of :meth:`write` on the combined results, in place."""
        self._update_units(kind, params, views, divide=False)

    def _update_units(self, kind: StepKind, params: Sequence[Tensor], views: Sequence[Tensor], divide: bool) -> None:
        if kind not in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM):
            return
        for group, ps, vs in self.opt.grouped(params, views):
            weights = F.update_unit_weights([self.opt.state[p]["exp_avg_sq"] for p in ps], group["eps"])
            (torch._foreach_div_ if divide else torch._foreach_mul_)(list(vs), weights)

    def scale_samples(self, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> Tensor:
        """Samples of ``follow_gradient_scale`` from local gradients (:func:`._grad_scale.scale_samples`)."""
        opt = self.opt
        return _grad_scale.scale_samples(
            params, grads, lambda p: opt.state.get(p, {}), opt.group_of, opt.schedule["variance_updates"]
        )

    def exact_floats(self, kind: StepKind, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> Tensor | None:
        """The floats a ``kind`` step averages exactly beside its message, or ``None``.

        1-bit momentum steps: each local gradient's squared norm (clipping sees gradient-sized
        norms, see :meth:`read_momentum`), then the samples of ``follow_gradient_scale`` when it is
        on; exact steps: those samples when it is on.
        """
        follow = self.opt.follow_gradient_scale
        if kind is StepKind.ONEBIT_MOMENTUM:
            floats = F.local_sq_norms(grads)
            return torch.cat([floats, self.scale_samples(params, grads)]) if follow else floats
        if kind is StepKind.EXACT and follow:
            return self.scale_samples(params, grads)
        return None

    def read_momentum(self, params: Sequence[Tensor], views: Sequence[Tensor], floats: Tensor) -> None:
        """Combined momenta (in parameter units) into gradient-sized implied gradients, in place.

        ``floats`` is the mean over ranks of :meth:`exact_floats`. Each view becomes the gradient its
        momentum implies (:func:`._functional.implied_gradients`), rescaled to the root mean square
        over ranks of the local gradient norms (:func:`._functional.norm_proxy_factors`), so that
        clipping sees a gradient-sized norm; :meth:`undo_norm_proxy` divides the factor out.
        """
        opt = self.opt
        for group, ps, vs in opt.grouped(params, views):
            F.implied_gradients([opt.state[p]["exp_avg"] for p in ps], vs, group["betas"][0])
        for p, entry in zip(params, F.norm_proxy_factors(views, floats[: len(params)])):
            self.norm_proxy_factors[p] = entry
        if opt.follow_gradient_scale:
            opt.grad_scale.record(params, floats[len(params) :])

    def undo_norm_proxy(self, p: Tensor, value: Tensor) -> Tensor:
        """The implied gradient back from what :meth:`read_momentum` handed on (and clipping left).

        If clipping cut it to less than ``_SPIKE_CLIP`` of its norm (a spike, not the routine
        clipping of a run whose gradients hover above the threshold), the error-feedback buffers
        of ``p`` are scaled by the same factor: they hold the rest of this step's message, and the
        spike left there would otherwise flow into the next steps' messages, past the clipping.
        Routine clipping leaves them alone: scaling them on every step discards the compression
        residuals error feedback needs. The fraction is noted here and acted on by
        :meth:`contain_spikes`, which reads all of a step's fractions on the host at once.
        """
        entry = self.norm_proxy_factors.pop(p, None)
        if entry is None:
            return value
        factor, handed_norm = entry
        clipped = torch.linalg.vector_norm(value.float()) / handed_norm
        self.opt.grad_scale.note_kept(p, kept_fraction(clipped))
        self._clip_fractions.append((p, clipped))
        return value / factor.to(value.dtype)

    def contain_spikes(self) -> None:
        """Scale the error buffers of the parameters :meth:`undo_norm_proxy` found spiked.

        One host read per step (a GPU sync), not one per parameter; per-parameter reads only on a
        step with a spike.
        """
        pending, self._clip_fractions = self._clip_fractions, []
        if not pending:
            return
        home = pending[0][1].device
        if not bool(torch.stack([f.to(home) for _, f in pending]).lt(_SPIKE_CLIP).any()):
            return
        for p, clipped in pending:
            if bool(clipped < _SPIKE_CLIP):
                for key in _ERROR_BUFFERS:
                    if key in self.opt.state[p]:
                        self.opt.state[p][key].mul_(clipped)
