"""Checkpoints of the compressed optimizers: schedule counters, rank identity and fp32 error buffers.

Mixed into :class:`~hf_zeroone.optim.CompressedAdamBase`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hf_zeroone.optim import _grad_scale
from hf_zeroone.optim._flat import ERROR_STATE, restore_errors

_STATE_KEY = "hf_zeroone"
#: state entries restored as float32 by load_state_dict (torch would cast them to the parameter's dtype)
_FP32_ON_LOAD = ERROR_STATE + _grad_scale.STATE_KEYS


class CheckpointMixin:
    """``state_dict`` / ``load_state_dict`` that keep what a resumed run needs to continue exactly."""

    state: Any
    schedule: dict[str, Any]
    schedule_params: tuple[str, ...]

    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state plus the schedule counters and this rank's identity.

        Per-parameter state includes this rank's error buffers; save one file per rank to keep
        them (they differ between ranks): ``worker_error`` shaped like the parameter, and
        ``server_error``, one-dimensional, only the elements this rank serves, which start at
        element ``server_error_start`` of the flattened parameter (see :mod:`._flat`). Everything is
        plain tensors, numbers and strings, so it loads with ``torch.load(..., weights_only=True)``.
        """
        sd = super().state_dict()
        sd[_STATE_KEY] = {
            "optimizer": type(self).__name__,
            "schedule": dict(self.schedule),
            "hyperparameters": {name: getattr(self, name) for name in self.schedule_params},
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
        }
        return sd

    def defer_rank_state(self, state_dict: dict[str, Any]) -> None:
        """Make the next :meth:`load_state_dict` load ``state_dict`` instead of the state it is given.

        For frameworks that hand every rank the state saved by rank 0 (``accelerate``'s
        ``load_state``): each rank defers its own saved state first, keeping its error buffers.
        """
        self._deferred_state = state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; error buffers from another world size or rank are reset.

        Checkpoints of earlier versions, whose ``server_error`` entries are full-size, load too.
        """
        deferred, self._deferred_state = getattr(self, "_deferred_state", None), None
        state_dict = dict(deferred if deferred is not None else state_dict)
        extra = state_dict.pop(_STATE_KEY, None)
        if extra is None:
            raise ValueError(
                f"this state dict was not saved by a hf_zeroone optimizer; {type(self).__name__} "
                "needs its schedule counters (start a fresh optimizer instead)"
            )
        if extra.get("optimizer") != type(self).__name__:
            raise ValueError(
                f"state dict was saved by {extra.get('optimizer')}, cannot load it into {type(self).__name__}"
            )
        saved = extra.get("hyperparameters", {})
        mine = {name: getattr(self, name) for name in self.schedule_params}
        differing = {name: (saved[name], mine[name]) for name in mine if name in saved and saved[name] != mine[name]}
        if differing:
            listing = ", ".join(f"{n}: checkpoint {a!r}, this optimizer {b!r}" for n, (a, b) in differing.items())
            fix = ", ".join(f"{n}={a!r}" for n, (a, _) in differing.items())
            raise ValueError(
                f"{type(self).__name__}: the checkpoint's schedule differs from this optimizer's ({listing}). "
                "Resuming on another schedule would restart phases whose state is gone; build the optimizer "
                f"with the checkpoint's values ({fix}), e.g. pass them explicitly to the Trainer, or start afresh."
            )
        same_rank = extra.get("world_size") == self.comm.world_size and extra.get("rank") == self.comm.rank
        if not same_rank:
            warnings.warn(
                f"{type(self).__name__}: checkpoint saved on rank {extra.get('rank')} of "
                f"{extra.get('world_size')}, loading on rank {self.comm.rank} of {self.comm.world_size}: "
                "error-feedback buffers reset to zero (momentum, variance and schedule are kept)",
                UserWarning,
                stacklevel=2,
            )
            state_dict["state"] = {
                k: {n: v for n, v in s.items() if n not in ERROR_STATE} for k, s in state_dict["state"].items()
            }
        if any("momentum_accumulator" in s for s in state_dict["state"].values()):
            raise ValueError(
                "this checkpoint comes from an earlier development version of hf_zeroone whose 0/1 Adam "
                "accumulated local updates in momentum space ('momentum_accumulator'); it cannot be resumed "
                "exactly. Resume from a checkpoint taken before var_freeze_step, or start the optimizer afresh."
            )
        # torch casts every floating-point state tensor to its parameter's dtype; the error buffers
        # stay float32 (a bf16 model keeps fp32 error feedback), so they are restored here.
        errors = {k: {n: v for n, v in s.items() if n in ERROR_STATE} for k, s in state_dict["state"].items()}
        scales = {
            k: {n: v for n, v in s.items() if n in _grad_scale.STATE_KEYS} for k, s in state_dict["state"].items()
        }
        state_dict["state"] = {
            k: {n: v for n, v in s.items() if n not in _FP32_ON_LOAD} for k, s in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            restore_errors(self.state[p], p, errors.get(saved_id, {}))
            for name, value in scales.get(saved_id, {}).items():
                self.state[p][name] = value.to(device=p.device, dtype=torch.float32, copy=True)
        for state in self.state.values():
            for name in ("momentum_mask", "pending_rows"):  # booleans, cast to the parameter's dtype by torch
                if name in state:
                    state[name] = state[name] != 0
        self.schedule = dict(extra["schedule"])
        self._flat_cache.clear()
        self._prepared_step = -1
        self.communicated_step = None
