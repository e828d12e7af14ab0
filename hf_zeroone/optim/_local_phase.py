"""0/1 Adam's local phase: the parameters of the last sync, the displacement ``u`` and the sync.

Mixed into :class:`~hf_zeroone.optim.CompressedAdamBase`; the maths is in
:class:`~hf_zeroone.optim.ZeroOneAdam`'s docstring.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hf_zeroone.optim._step_kind import StepKind


class LocalPhaseMixin:
    """Entering the local phase, deriving ``u``, applying a sync, discarding a failed interval."""

    state: Any
    schedule: dict[str, Any]

    @staticmethod
    def _accumulates_displacement(p: Tensor) -> bool:
        """Whether ``p`` keeps 0/1 Adam's ``u`` in a buffer instead of deriving it (see :meth:`_displacement`)."""
        return p.dtype not in (torch.float32, torch.float64)

    def _displacement(self, p: Tensor, out: Tensor) -> None:
        """0/1 Adam's ``u`` for ``p`` into ``out`` (fp32): what the local steps since the last sync moved it.

        Derived as ``u = decay_prod * sync_param - p`` (no buffer held): a sync then sets
        ``p = decay_prod * sync_param - u_avg``, which without compression is exactly where the
        local steps left ``p``. A parameter below fp32 (bf16, fp16) accumulates ``u`` in a buffer
        instead, since each local step's rounding of ``p`` to its own precision would drop updates
        the accumulator keeps.
        """
        state = self.state[p]
        if "update_accumulator" in state:
            out.copy_(state["update_accumulator"])
        elif p.dtype == out.dtype:
            torch.mul(state["sync_param"], state["decay_prod"], out=out).sub_(p)
        else:
            out.copy_(state["sync_param"].mul(state["decay_prod"]).sub_(p))

    def _apply_sync(self, group: dict[str, Any], p: Tensor, combined_u: Tensor, kind: StepKind) -> None:
        """Back to the last synced parameters, then the averaged accumulated update (in parameter space)."""
        state = self.state[p]
        c1, c2 = self._coefficients(group, kind)
        combined_u = combined_u.to(p.dtype)
        p.copy_(state["sync_param"]).mul_(state["decay_prod"]).sub_(combined_u)
        if state["lr_sum"] > 0:
            denom = self._denominator(group, p, kind, c2)
            state["exp_avg"].copy_(combined_u).mul_(denom).mul_(c1 / state["lr_sum"])
        if "update_accumulator" in state:
            if self._accumulates_displacement(p):
                state["update_accumulator"].zero_()
            else:  # derived from now on (a checkpoint of an earlier version brought one)
                del state["update_accumulator"]
        state["sync_param"].copy_(p)
        state["lr_sum"], state["decay_prod"] = 0.0, 1.0

    def _discard_interval(self, p: Tensor) -> None:
        """Back to the last synced parameters with zero momentum: identical and finite on every rank."""
        state = self.state[p]
        p.copy_(state["sync_param"])
        state["exp_avg"].zero_()
        if "update_accumulator" in state:
            state["update_accumulator"].zero_()
        state["lr_sum"], state["decay_prod"] = 0.0, 1.0

    def _start_local_phase(self) -> None:
        """Entering local steps: remember the synced parameters, reset u and the error buffers."""
        for _, p in self.trainable_params():
            state = self.state[p]
            state["sync_param"] = p.detach().clone()
            if self._accumulates_displacement(p):
                state["update_accumulator"] = torch.zeros_like(p)
            else:
                state.pop("update_accumulator", None)
            state["lr_sum"], state["decay_prod"] = 0.0, 1.0
            # The errors so far belong to compressed gradients, not to u (as DeepSpeed does).
            for key in ("worker_error", "server_error"):
                if key in state:
                    state[key].zero_()
        self.schedule["local_phase_started"] = True
