"""Communication in ``step()``: every parameter's message combined across ranks when no DDP hook ran.

Also the other half of the 1-bit momentum step's norm proxy (:meth:`StepPathMixin._undo_norm_proxy`),
which both paths use. Mixed into :class:`~hf_zeroone.optim.CompressedAdamBase`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from hf_zeroone.optim._flat import consecutive_views, split_in_buckets
from hf_zeroone.optim._grad_scale import kept_fraction
from hf_zeroone.optim._step_kind import StepKind

#: clipping that keeps less than this fraction of 1-bit Adam's implied gradient is treated as a
#: spike: the error buffers are scaled with it (see StepPathMixin._undo_norm_proxy)
_SPIKE_CLIP = 0.1
#: the error-feedback buffers a spike is removed from
_ERROR_BUFFERS = ("worker_error", "server_error")


class StepPathMixin:
    """``step()``'s own exchange (no hook), and spike containment after clipping."""

    state: Any
    schedule: dict[str, Any]

    def _exchange(self, kind: StepKind) -> list[tuple[dict[str, Any], Tensor, Tensor]]:
        """Compute every parameter's message and combine across ranks; no DDP hook involved."""
        pairs = self.trainable_params()
        if not pairs:
            return []
        params = [p for _, p in pairs]
        if not self.comm.is_distributed:
            # A single process sends nothing; the "combined" value is the message itself.
            results = []
            for group, p in pairs:
                if p.grad is None:
                    continue  # like torch.optim: a parameter without gradient is left alone
                out = torch.empty_like(p, dtype=torch.float32)
                self.write_message(group, p, p.grad, kind, out)
                if kind.compressed and "momentum_mask" in self.state[p]:
                    out.mul_(self.state[p]["momentum_mask"])  # as the compressed allreduce does
                if kind is StepKind.ONEBIT_MOMENTUM:
                    self.implied_gradient(group, p, out)
                results.append((group, p, out))
            if self.follow_gradient_scale and kind in (StepKind.EXACT, StepKind.ONEBIT_MOMENTUM) and results:
                used = [p for _, p, _ in results]
                self.record_grad_sq(used, self.scale_samples(used, [p.grad for p in used]))
            return results
        results: list[tuple[dict[str, Any], Tensor, Tensor]] = []
        for bucket in split_in_buckets(pairs, self.step_bucket_numel):  # one bucket's message at a time
            bucket_params = [p for _, p in bucket]
            if kind.compressed:
                flat = self.flat_buffers(bucket_params)
                message, views = flat.new_message(), flat.views
                message[flat.layout.numel :].zero_()
            else:
                numel = sum(p.numel() for p in bucket_params)
                message = torch.empty(numel, dtype=torch.float32, device=params[0].device)
                views = functools.partial(consecutive_views, bucket_params)
            for (group, p), view in zip(bucket, views(message)):
                self.write_message(group, p, p.grad, kind, view)
                self.to_update_units(group, p, kind, view)
            if kind.compressed:
                combined = self.comm.compressed_allreduce(message, flat.worker_error, flat.server_error, flat.layout)
            else:
                combined = self.comm.allreduce_mean(message)
            del message  # the compressed allreduce's scratch: freed before the next bucket
            for (group, p), view in zip(bucket, views(combined)):
                self.from_update_units(group, p, kind, view)
            results += [(group, p, view) for (group, p), view in zip(bucket, views(combined))]
        grads = [p.grad for p in params]
        if kind is StepKind.EXACT and self.follow_gradient_scale:
            self.record_grad_sq(params, self.comm.allreduce_mean(self.scale_samples(params, grads)))
        if kind is StepKind.ONEBIT_MOMENTUM:
            # one collective: the local squared norms (clipping), and the scale samples when asked for
            floats = self.local_sq_norms(grads)
            if self.follow_gradient_scale:
                floats = torch.cat([floats, self.scale_samples(params, grads)])
            floats = self.comm.allreduce_mean(floats.to(params[0].device))
            mean_sq = floats[: len(params)]
            if self.follow_gradient_scale:
                self.record_grad_sq(params, floats[len(params) :])
            for group, p, view in results:
                self.implied_gradient(group, p, view)
            self.norm_proxy(params, [v for _, _, v in results], mean_sq)  # as the hook does, so that
            # back into the combined buffer: one parameter's worth of scratch at a time
            results = [(g, p, v.copy_(self._undo_norm_proxy(p, v))) for g, p, v in results]  # both agree
        return results

    def _undo_norm_proxy(self, p: Tensor, value: Tensor) -> Tensor:
        """The implied gradient back from what :meth:`norm_proxy` handed on (and clipping left).

        If clipping cut it to less than ``_SPIKE_CLIP`` of its norm (a spike, not the routine
        clipping of a run whose gradients hover above the threshold), the error-feedback buffers
        of ``p`` are scaled by the same factor: they hold the rest of this step's message, and the
        spike left there would otherwise flow into the next steps' messages, past the clipping.
        Routine clipping leaves them alone: scaling them on every step discards the compression
        residuals error feedback needs. The fraction is noted here and acted on by
        :meth:`_contain_spikes`, which reads all of a step's fractions on the host at once.
        """
        entry = self._norm_proxy_factors.pop(p, None)
        if entry is None:
            return value
        factor, handed_norm = entry
        clipped = torch.linalg.vector_norm(value.float()) / handed_norm
        self._kept_fraction[p] = kept_fraction(clipped)
        self._clip_fractions.append((p, clipped))
        return value / factor.to(value.dtype)

    def _contain_spikes(self) -> None:
        """Scale the error buffers of the parameters :meth:`_undo_norm_proxy` found spiked.

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
                state = self.state[p]
                for key in _ERROR_BUFFERS:
                    if key in state:
                        state[key].mul_(clipped)
