"""Checkpoints of the compressed optimizers: schedule counters, rank identity and fp32 error buffers.

:class:`~hf_zeroone.optim.CompressedAdamBase` calls these around torch's own ``state_dict`` and
``load_state_dict``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from hf_zeroone.optim import _grad_scale, _masks
from hf_zeroone.optim._flat import ERROR_STATE, restore_errors

_STATE_KEY = "hf_zeroone"
#: state entries restored as float32 by load_state_dict (torch would cast them to the parameter's dtype)
_FP32_ON_LOAD = ERROR_STATE + _grad_scale.STATE_KEYS


def add_extra(sd: dict[str, Any], opt: Any) -> dict[str, Any]:  # noqa: ANN401 - a CompressedAdamBase
    """Torch's optimizer state plus the schedule counters and this rank's identity.

    Per-parameter state includes this rank's error buffers; save one file per rank to keep them
    (they differ between ranks): ``worker_error`` shaped like the parameter, and ``server_error``,
    one-dimensional, only the elements this rank serves, which start at element
    ``server_error_start`` of the flattened parameter (see :mod:`._flat`). Everything is plain
    tensors, numbers and strings, so it loads with ``torch.load(..., weights_only=True)``.
    """
    sd[_STATE_KEY] = {
        "optimizer": type(opt).__name__,
        "schedule": dict(opt.schedule),
        "hyperparameters": opt._schedule_hyperparameters(),
        "world_size": opt.comm.world_size,
        "rank": opt.comm.rank,
    }
    return sd


def split_for_torch(opt: Any, state_dict: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], None]]:  # noqa: ANN401
    """Check ``state_dict`` against ``opt``; return what torch's ``load_state_dict`` should load, and
    a function that restores the rest once it has (schedule, float32 error buffers and scale samples).

    Error buffers from another world size or rank are dropped with a warning; a checkpoint of
    another optimizer or schedule is refused with the values to use.
    """
    name = type(opt).__name__
    state_dict = dict(state_dict)
    extra = state_dict.pop(_STATE_KEY, None)
    if extra is None:
        raise ValueError(
            f"this state dict was not saved by a hf_zeroone optimizer; {name} "
            "needs its schedule counters (start a fresh optimizer instead)"
        )
    if extra.get("optimizer") != name:
        raise ValueError(f"state dict was saved by {extra.get('optimizer')}, cannot load it into {name}")
    saved = opt._saved_schedule_hyperparameters(dict(extra.get("hyperparameters", {})))
    mine = opt._schedule_hyperparameters()
    differing = {n: (saved[n], mine[n]) for n in mine if n in saved and saved[n] != mine[n]}
    if differing:
        listing = ", ".join(f"{n}: checkpoint {a!r}, this optimizer {b!r}" for n, (a, b) in differing.items())
        fix = ", ".join(f"{n}={a!r}" for n, (a, _) in differing.items())
        raise ValueError(
            f"{name}: the checkpoint's schedule differs from this optimizer's ({listing}). "
            "Resuming on another schedule would restart phases whose state is gone; build the optimizer "
            f"with the checkpoint's values ({fix}), e.g. pass them explicitly to the Trainer, or start afresh."
        )
    _check_shapes(opt, state_dict)
    states = {
        k: {n: v for n, v in st.items() if n not in _grad_scale.LEGACY_KEYS} for k, st in state_dict["state"].items()
    }
    if not (extra.get("world_size") == opt.comm.world_size and extra.get("rank") == opt.comm.rank):
        warnings.warn(
            f"{name}: checkpoint saved on rank {extra.get('rank')} of {extra.get('world_size')}, loading on rank "
            f"{opt.comm.rank} of {opt.comm.world_size}: error-feedback buffers reset to zero (momentum, variance "
            "and schedule are kept)",
            UserWarning,
            stacklevel=3,
        )
        states = {k: {n: v for n, v in s.items() if n not in ERROR_STATE} for k, s in states.items()}
    if any("momentum_accumulator" in s for s in states.values()):
        raise ValueError(
            "this checkpoint comes from an earlier development version of hf_zeroone whose 0/1 Adam "
            "accumulated local updates in momentum space ('momentum_accumulator'); it cannot be resumed "
            "exactly. Resume from a checkpoint taken before var_freeze_step, or start the optimizer afresh."
        )
    # torch casts every floating-point state tensor to its parameter's dtype; the error buffers
    # stay float32 (a bf16 model keeps fp32 error feedback), so they are restored afterwards.
    errors = {k: {n: v for n, v in s.items() if n in ERROR_STATE} for k, s in states.items()}
    scales = {k: {n: v for n, v in s.items() if n in _grad_scale.STATE_KEYS} for k, s in states.items()}
    state_dict["state"] = {k: {n: v for n, v in s.items() if n not in _FP32_ON_LOAD} for k, s in states.items()}

    def restore() -> None:
        for saved_id, p in _paired(opt, state_dict):
            restore_errors(opt.state[p], p, errors.get(saved_id, {}))
            for key, value in scales.get(saved_id, {}).items():
                opt.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
        for state in opt.state.values():
            for key in ("momentum_mask", "pending_rows"):  # booleans, cast to the parameter's dtype by torch
                if key in state:
                    state[key] = state[key] != 0
            _masks.index_masked_rows(state)  # older checkpoints hold no index
        opt.schedule = {k: v for k, v in extra["schedule"].items() if k not in opt._retired_schedule_keys}
        # older checkpoints hold no variance_steps: each variance update counted as one step
        opt.schedule.setdefault("variance_steps", opt.schedule["variance_updates"])

    return state_dict, restore


#: per-parameter state entries shaped like their parameter
_PARAMETER_SHAPED = ("exp_avg", "exp_avg_sq", "worker_error", "momentum_mask", "sync_param")


def _check_shapes(opt: Any, state_dict: dict[str, Any]) -> None:  # noqa: ANN401 - a CompressedAdamBase
    """``ValueError`` before anything is loaded if a saved state entry's shape is not its parameter's.

    Torch pairs saved and current parameters by position and checks only their number; a
    checkpoint of another model would load, replace the state, and fail at the next step.
    Groups of other lengths are left to torch, which refuses them.
    """
    groups = state_dict.get("param_groups", [])
    if len(groups) != len(opt.param_groups) or any(
        len(saved["params"]) != len(mine["params"]) for saved, mine in zip(groups, opt.param_groups)
    ):
        return
    for index, (saved_id, p) in enumerate(_paired(opt, state_dict)):
        for key, value in state_dict["state"].get(saved_id, {}).items():
            if key in _PARAMETER_SHAPED and isinstance(value, torch.Tensor) and value.shape != p.shape:
                raise ValueError(
                    f"{type(opt).__name__}: the checkpoint's {key!r} of parameter {index} has shape "
                    f"{tuple(value.shape)}, but that parameter has shape {tuple(p.shape)}: the checkpoint "
                    "belongs to another model (or its parameters in another order). Nothing was loaded; "
                    "build the optimizer from the model the checkpoint was saved with."
                )


def _paired(opt: Any, state_dict: dict[str, Any]) -> list[tuple[Any, torch.Tensor]]:  # noqa: ANN401
    """``(saved id, parameter)`` in order, as torch pairs a checkpoint's parameters with the optimizer's."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    return list(zip(saved_ids, [p for g in opt.param_groups for p in g["params"]]))
