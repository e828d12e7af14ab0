"""What each rank sends in a step, and what the combined result becomes: the optimizer's message protocol.

Both communication paths use it: the DDP hook (:mod:`hf_zeroone.ddp_hook`), bucket by bucket
during backward, and ``step()``'s own exchange (:mod:`._exchange`). For every kind of
:mod:`._base`'s table:

1. :meth:`Messages.write`: each parameter's message into a flat buffer's views (compressed
   gradient and momentum messages in units of the update);
2. :meth:`Messages.lane`: the floats that travel exactly beside the messages, in the same
   collectives (per-tensor squared norms, the samples of ``follow_gradient_scale``, mask flags);
3. after the collective, :meth:`Messages.finish`: results out of update units, a 1-bit momentum
   turned into a gradient-sized implied gradient (``step()`` takes it back with
   :meth:`Messages.undo_norm_proxies`), the samples recorded, the masked rows agreed.

The 1-bit kinds ``ONEBIT_GRADIENT`` and ``ONEBIT_MOMENTUM`` clip each local gradient to the
frozen variance (:func:`._functional.clip_to_variance`) and send their message in units of the
update, divided by per-element weights derived from ``v`` (the same on every rank); the combined
result is multiplied back (:func:`._functional.to_update_units`). Every element's compression
error is then a bounded number of learning rates, whatever its own variance and its neighbours'.
``ONEBIT_SYNC``'s ``u`` is a parameter displacement, sent per unit of the learning rate summed over
its interval (:func:`._local_phase.per_lr_units`), so that its error feedback, like the 1-bit
momentum's, is paid back at the learning rate of the step that pays it.

For ``ONEBIT_MOMENTUM`` the combined momentum ``m'`` is turned into the gradient it implies,
``g = (m' - beta1 * m) / (1 - beta1)``, identical on every rank; ``m <- beta1 * m + (1 - beta1) * g``
then gives back ``m'``. That ``g`` carries the 1-bit compression noise times ``1 / (1 - beta1)``:
its norm can be many times the true gradient's, and a clipping threshold meant for gradients
would cut every step. So ``g`` is handed on rescaled, per tensor, to an estimate of the averaged
gradient's norm: the mean over ranks of the local squared norms (exact: one float per tensor,
averaged alongside), divided by the local gradients' noise excess that the exact steps measured
(``Messages._averaged_sq_norms``); ``step()`` divides the factor out again. Unclipped, the step
reproduces ``m'``; clipped by ``s``, the step's gradient contribution is ``s * g``, so clipping
sees a gradient-sized norm and still damps a real spike. On every other step that communicates,
``p.grad`` after a DDP hook is an averaged gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from hf_zeroone._tensors import apply_per_tensor, float32_norms, host_index, moved, per_tensor_in_dtypes, picked
from hf_zeroone.optim import _functional as F
from hf_zeroone.optim import _grad_scale, _local_phase, _masks
from hf_zeroone.optim._flat import layout_order
from hf_zeroone.optim._grad_scale import kept_fraction, norm_left
from hf_zeroone.optim._onebit_messages import BucketUnits, onebit_messages
from hf_zeroone.optim._scalar_vectors import Noted
from hf_zeroone.optim._step_kind import StepKind

__all__ = ["Messages"]

#: clipping that keeps less than this fraction of 1-bit Adam's implied gradient is treated as a
#: spike: the error buffers are scaled with it (see Messages.undo_norm_proxies)
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
        #: per parameter, the factor (float32) :meth:`finish` applied to this step's implied gradient,
        #: or :meth:`hand_on_local_gradients` to a local one
        self.proxy_factors = Noted()
        #: per parameter, the norm :meth:`finish` handed on (implied gradients only)
        self.handed_norms = Noted()
        #: per chunk of parameters, the fraction of each handed-on norm that clipping left (see contain_spikes)
        self._clip_fractions: list[tuple[list[Tensor], Tensor]] = []
        #: per parameter, the mean over ranks of the local samples summed since the last sync
        self.pending_means = Noted()

    def write(
        self, kind: StepKind, params: Sequence[Tensor], grads: Sequence[Tensor | None], outs: Sequence[Tensor],
        message: Tensor | None = None, views: Callable[[Tensor], list[Tensor]] | None = None,
        flat_grads: Tensor | None = None,
    ) -> BucketUnits | None:  # fmt: skip
        """Write what this rank sends for each parameter in a ``kind`` step into ``outs`` (fp32, shaped like it).

        On the 1-bit gradient and momentum kinds each local gradient is first clipped to the frozen
        variance (:func:`._functional.clip_to_variance`, unless the optimizer's ``clip_to_variance``
        is off), and the message is put in units of the update (:func:`._functional.to_update_units`),
        on the bucket's flat tensors (:mod:`._onebit_messages`): ``message`` is the flat vector
        ``outs`` tile, ``views`` cuts a vector of its layout into such views, ``flat_grads`` are
        the gradients in that layout where they already are (a DDP bucket). Returns what
        :meth:`finish` takes the combined result out of the units with. Reads the optimizer state
        and leaves it unchanged, except for noting which masked rows received a gradient: a step
        that is later skipped (non-finite gradients, a GradScaler overflow) leaves no other trace.
        """
        opt, state = self.opt, self.opt.state
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        if kind is StepKind.EXACT:
            torch._foreach_copy_(list(outs), grads)
            return None
        if kind is StepKind.ONEBIT_SYNC:  # sent after this step's local update
            states = [state[p] for p in params]
            _local_phase.displacements(params, states, outs)
            _local_phase.idle_messages(opt, list(params), states, list(outs))
            # per unit of learning rate, in the frozen variance's units: see _local_phase.per_lr_units
            apply_per_tensor("div", list(outs), self.sync_units(params), in_place=True)
            return None
        if message is None or views is None:
            raise ValueError("a 1-bit message is written into a flat buffer: pass message= and views=")
        return onebit_messages(opt, kind, params, grads, outs, message, views, flat_grads)

    def errors_to_gradient_units(self, group: dict[str, Any], params: Sequence[Tensor]) -> list[Tensor]:
        """Before ``v`` changes: each error buffer of ``params`` into gradient units, in place; the parameters with one.

        The worker and server errors are in units of the update, ``w = d / mean(d)`` of the ``v``
        they were made with (:func:`._functional.to_update_units`). 0/1 Adam updates ``v`` between
        its 1-bit gradient steps, and releasing masked rows writes into ``v`` too; a buffer read in
        the new units would pay back ``e * w_new``, not the ``e * w_old`` that was withheld, and
        error feedback would no longer sum to what the exact steps would have applied. So the
        buffers go to gradient units (``e * w_old``) before the change and back
        (:meth:`errors_to_update_units`) after it: the same error in gradient space
        (``tests/test_zeroone_error_units.py``). One parameter at a time, so that no full-size
        copy of the model is held. Without this, 0/1 Adam trained without gradient clipping ends
        measurably further from AdamW on language models.
        """
        held = [p for p in params if "worker_error" in self.opt.state[p]]
        self._convert_errors(group, held, F.from_update_units, self.opt._variance_correction(group))
        return held

    def errors_to_update_units(self, group: dict[str, Any], params: Sequence[Tensor], c2: float) -> None:
        """After ``v`` changed: the buffers :meth:`errors_to_gradient_units` converted, back into update units.

        ``c2``: the bias correction of the variance as it now stands.
        """
        self._convert_errors(group, params, F.to_update_units, c2)

    def _convert_errors(self, group: dict[str, Any], params: Sequence[Tensor], convert, c2: float) -> None:  # noqa: ANN001
        for p in params:
            state = self.opt.state[p]
            (d,), stats = self.opt.plain_denominators(group, [p], c2)
            convert(state["worker_error"], d.view_as(state["worker_error"]), stats.means.reshape(()))
            server = state.get("server_error")
            if server is not None and server.numel():
                start = int(state.get("server_error_start", 0))
                convert(server, layout_order(d, p)[start : start + server.numel()], stats.means.reshape(()))
            self.opt.variance_views.release([p])

    def sync_units(self, params: Sequence[Tensor]) -> list[float] | Tensor:
        """The divisor of each parameter's sync message (:func:`._local_phase.per_lr_units`), in order."""
        opt = self.opt
        states = [opt.state[p] for p in params]
        if not opt.follow_gradient_scale:
            return _local_phase.per_lr_units(states)
        positions: list[int] = []
        parts: list[Tensor] = []
        for group, ps, index in opt.grouped(params, range(len(params))):
            scaled = opt.scale_factors(group, ps)
            if not isinstance(scaled, Tensor):  # some without a factor: 1
                index = [i for i, f in zip(index, scaled) if f is not None]
                scaled = torch.stack([f for f in scaled if f is not None]) if index else None
            if scaled is not None:
                positions += index
                parts.append(moved(scaled, dtype=torch.float32))
        if not parts:
            return _local_phase.per_lr_units(states)
        factors = torch.cat([moved(t, parts[0].device) for t in parts]) if len(parts) > 1 else parts[0]
        if positions != list(range(len(params))):  # 1 where none
            ones = torch.ones(len(params), dtype=torch.float32, device=factors.device)
            factors = ones.index_copy_(0, host_index(positions, factors.device), factors)
        return _local_phase.per_lr_units(states, factors)

    def scale_samples(self, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> Tensor:
        """Samples of ``follow_gradient_scale`` from local gradients (:func:`._grad_scale.scale_samples`), in order."""
        opt = self.opt
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        out: dict[int, Tensor] = {}
        groups = opt.grouped(params, grads)
        for group, ps, gs in groups:
            dens, stats = opt.plain_denominators(group, ps, opt._variance_correction(group))
            values = _grad_scale.scale_samples(gs, dens, stats.means, stats.counts, stats.idle, stats.idle_eps)
            if len(groups) == 1:  # one group's tensors, in the order asked
                return values
            out.update(zip(map(id, ps), values.unbind()))
        return torch.stack([out[id(p)] for p in params])

    def lane(self, kind: StepKind, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> Tensor | None:
        """The floats a ``kind`` step averages exactly beside the messages of ``params`` (its exact lane), or ``None``.

        In this order: on 1-bit momentum steps each local gradient's squared norm (clipping sees
        gradient-sized norms, see :meth:`finish`); on 1-bit gradient and momentum steps, and on exact
        steps of several ranks, when ``follow_gradient_scale`` is on, its samples (:mod:`._grad_scale`);
        on compressed steps,
        one flag per masked row of ``params``, 1 where this rank's gradients touched it since the
        last agreement (:mod:`._masks`). Call it after :meth:`write` (which notes that activity).
        """
        parts = []
        if kind is StepKind.ONEBIT_MOMENTUM:
            parts.append(F.local_sq_norms(grads))
        if self.opt.follow_gradient_scale and (
            kind.communicates_in_backward and (kind.compressed or self.opt.comm.is_distributed)
        ):
            parts.append(self.scale_samples(params, grads))
        if kind is StepKind.ONEBIT_SYNC and self.opt.follow_gradient_scale:  # the interval's local samples
            parts.append(self.opt.gradient_scale.pending([self.opt.state[p] for p in params], params[0]))
        if kind.compressed:
            parts += [_masks.activity_flags(self.opt.state[p]) for p in params if "momentum_mask" in self.opt.state[p]]
        if not parts:
            return None
        device = next(iter(params)).device
        return torch.cat([moved(t, device, torch.float32) for t in parts])

    def finish(
        self, kind: StepKind, params: Sequence[Tensor], views: Sequence[Tensor], lane: Tensor | None,
        loss_scale: Tensor | None = None, units: BucketUnits | None = None,
    ) -> None:  # fmt: skip
        """Turn the combined ``views`` into what the step applies, in place; ``lane``: the averaged :meth:`lane`.

        Compressed results leave the update units of :meth:`write` (``units``: what it returned). A
        1-bit momentum becomes the gradient it implies (:func:`._functional.implied_gradients`),
        rescaled to an estimate of the averaged gradient's norm from the local norms (:meth:`_averaged_sq_norms`,
        :func:`._functional.norm_proxy_factors`), so that clipping sees the norm AdamW's would;
        :meth:`undo_norm_proxies` divides the factor out.
        On exact steps of several ranks, the samples of the local gradients (in ``lane``) and of the
        averaged ones (``views``, divided by ``loss_scale`` when a GradScaler scaled them) measure the
        local gradients' noise excess (see :mod:`._grad_scale`).
        """
        opt, n = self.opt, len(params)
        if kind in (StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_MOMENTUM):  # out of the units of write()
            if units is None:
                raise ValueError("finish() of a 1-bit message needs the units write() returned")
            F.from_update_units(units.message, units.plain, units.means)
            if kind is StepKind.ONEBIT_MOMENTUM:  # a combined momentum becomes the gradient it implies
                opt.variance_views.release(params)  # the denominators offered there: their memory takes m
                torch._foreach_copy_(units.plain_views, [opt.state[p]["exp_avg"] for p in params])
                F.implied_gradients(units.plain, units.message, units.beta1)
        if kind is StepKind.ONEBIT_SYNC:  # out of the units of write()
            apply_per_tensor("mul", list(views), self.sync_units(params), in_place=True)
        rest = lane
        if kind is StepKind.ONEBIT_MOMENTUM:
            factors, handed = F.norm_proxy_factors(views, self._averaged_sq_norms(params, rest[:n]))
            self.proxy_factors.note(params, factors)
            self.handed_norms.note(params, handed)
            rest = rest[n:]
        if opt.follow_gradient_scale and (
            kind.communicates_in_backward and (kind.compressed or opt.comm.is_distributed)
        ):
            opt.gradient_scale.record(params, rest[:n])
            rest = rest[n:]
            if kind is StepKind.EXACT:
                if loss_scale is not None:
                    views = [v / loss_scale.to(device=v.device, dtype=v.dtype) for v in views]
                opt.gradient_scale.record_averaged(params, self.scale_samples(params, views))
        if kind is StepKind.ONEBIT_SYNC and opt.follow_gradient_scale:
            self.pending_means.note(params, rest[:n])
            rest = rest[n:]
        if kind.compressed:
            for p in params:
                state = opt.state[p]
                if "momentum_mask" in state:
                    count = state["masked_rows_index"].numel()  # no host read of a device value
                    state["agreed_rows"] = _masks.scatter_flags(state, rest[:count])
                    rest = rest[count:]
        opt.variance_views.release(params)  # this bucket's denominators: no full-size copy outlives it

    def _averaged_sq_norms(self, params: Sequence[Tensor], local_mean: Tensor) -> Tensor:
        """The squared norm of each averaged gradient, estimated from the mean over ranks of the local ones.

        A local gradient is noisier than the average of the ranks' gradients, so the mean of the
        local squared norms exceeds the averaged gradient's, by the noise: about twice on 2 ranks
        once noise dominates. Handed on with that norm, the implied gradient would meet the user's
        clipping at a larger norm than AdamW's averaged gradient does, and be cut on steps where
        AdamW's is not (``docs/step_kinds_and_clipping.md``). Divided by the noise excess ``rho``
        that the exact steps of several ranks measured
        (:meth:`._grad_scale.GradientScale.noise_excess`, at least 1), it estimates what AdamW's
        clipping sees. Without ``rho`` (one rank, ``follow_gradient_scale=False``), the mean itself.
        """
        positions, rho = self._noise_excesses(params)
        if rho is None:
            return local_mean
        rho = moved(rho, local_mean.device)
        if positions != list(range(len(params))):  # 1 where none was measured
            rho = torch.ones_like(local_mean).index_copy_(0, host_index(positions, local_mean.device), rho)
        return local_mean / rho

    def _noise_excesses(self, params: Sequence[Tensor]) -> tuple[list[int], Tensor | None]:
        """The positions in ``params`` of the tensors whose noise excess ``rho`` was measured, and ``rho`` (at least 1).

        :meth:`._grad_scale.GradientScale.noise_excess`: measured on the exact steps of several
        ranks when ``follow_gradient_scale`` is on. ``None``: none measured.
        """
        opt = self.opt
        positions: list[int] = []
        parts: list[Tensor] = []
        for group, ps, index in opt.grouped(params, range(len(params))):
            rho = _grad_scale.GradientScale.noise_excess([opt.state[p] for p in ps], group["betas"][1], opt.schedule)
            if rho is not None:
                positions += index
                parts.append(rho.clamp(min=1.0))
        if not parts:
            return [], None
        return positions, parts[0] if len(parts) == 1 else torch.cat([moved(t, parts[0].device) for t in parts])

    def hand_on_local_gradients(
        self, params: Sequence[Tensor], grads: Sequence[Tensor], in_place: bool
    ) -> list[Tensor]:
        """A local step's gradients as the user's clipping should see them: each divided by ``sqrt(rho)``.

        On 0/1 Adam's ``LOCAL`` and ``ONEBIT_SYNC`` steps each rank steps on its own gradient.
        AdamW's clipping sees the averaged gradient, whose norm is smaller, by the noise that
        averaging removes: the user's threshold, meant for that norm, would meet the local one and
        cut steps that AdamW's leaves alone. Each local gradient is handed on divided by the
        square root of its tensor's noise excess (:meth:`_noise_excesses`), so that its squared
        norm estimates the averaged gradient's, as on 1-bit Adam's momentum steps;
        :meth:`undo_norm_proxies` scales it back, so that, unclipped, the step applies the local
        gradient, and clipped by ``s``, ``s`` times it. Without ``rho`` (one rank,
        ``follow_gradient_scale=False``) nothing changes.

        The DDP hook scales its bucket's views in place; ``step()`` without the hook scales new
        tensors (``in_place=False``, the user's ``p.grad`` untouched), so both paths agree bit for
        bit. Each factor is rounded to its gradient's dtype both ways: the round trip then loses at
        most the last bits.
        """
        out = list(grads)
        positions, rho = self._noise_excesses(params)
        if rho is None:
            return out
        factors = rho.rsqrt()
        scaled = per_tensor_in_dtypes("mul", [grads[i] for i in positions], factors, in_place=in_place)
        for i, value in zip(positions, scaled):
            out[i] = value
        self.proxy_factors.note([params[i] for i in positions], factors)
        return out

    def undo_norm_proxies(self, params: Sequence[Tensor], values: Sequence[Tensor]) -> list[Tensor]:
        """Each implied gradient back from what :meth:`finish` handed on (and clipping left), or each local one.

        New tensors where a factor is divided out (:meth:`norm_proxy_divisors`); the others as they are.
        """
        return F.divided(values, *self.norm_proxy_divisors(params, values))

    def norm_proxy_divisors(
        self, params: Sequence[Tensor], values: Sequence[Tensor], norms: Tensor | None = None
    ) -> tuple[list[int], Tensor | None]:
        """What divides each value back into an implied gradient (or a local one): positions and float32 divisors.

        The positions in ``params`` of the parameters with a factor this step, and the factors as
        one vector (``None``: none); the others keep their value. A local gradient
        (:meth:`hand_on_local_gradients`) is only scaled back. Each divisor is rounded to its
        value's dtype before it divides (:func:`._functional.divided`); ``step()`` divides 1-bit
        Adam's float32 values inside the update (:func:`._functional.adam_update`). Every factor
        noted so far is used up. ``norms``: the values' :func:`float32_norms`, where already taken.

        If clipping cut an implied gradient to less than ``_SPIKE_CLIP`` of its norm (a spike, not
        the routine clipping of a run whose gradients hover above the threshold), the
        error-feedback buffers of its parameter are scaled by the same factor: they hold the rest
        of this step's message, and the spike left there would otherwise flow into the next steps'
        messages, past the clipping. Routine clipping leaves them alone: scaling them on every step
        discards the compression residuals error feedback needs. The fraction is noted here and
        acted on by :meth:`contain_spikes`, which reads all of a step's fractions on the host at once.
        """
        positions, factors = self.proxy_factors.gather(params)
        measured, handed = self.handed_norms.gather(params)
        self.proxy_factors.clear()
        self.handed_norms.clear()
        if measured:  # the norms clipping left over the norms handed on, as one vector for all tensors
            taken = float32_norms([values[i] for i in measured]) if norms is None else picked(norms, measured)
            clipped = norm_left(taken, moved(handed, dtype=torch.float32))
            chosen = [params[i] for i in measured]
            self.opt.gradient_scale.note_kept(chosen, kept_fraction(clipped))
            self._clip_fractions.append((chosen, clipped))
        return positions, factors

    def contain_spikes(self) -> None:
        """Scale the error buffers of the parameters :meth:`undo_norm_proxies` found spiked.

        One host read per step (a GPU sync), not one per parameter; per-parameter reads only on a
        step with a spike.
        """
        pending, self._clip_fractions = self._clip_fractions, []
        if not pending:
            return
        home = pending[0][1].device
        fractions = torch.cat([moved(f, home) for _, f in pending])
        spiked = fractions.lt(_SPIKE_CLIP)
        if not bool(spiked.any()):
            return
        chosen = [p for params, _ in pending for p in params]
        for p, clipped, spike in zip(chosen, fractions.unbind(), spiked.tolist()):
            if spike:
                for key in _ERROR_BUFFERS:
                    if key in self.opt.state[p]:
                        self.opt.state[p][key].mul_(clipped)
