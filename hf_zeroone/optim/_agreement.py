"""Before the first step: every rank built its optimizer alike, or a clear error on every rank.

The ranks' schedules decide which collectives each step makes. A setting that differs between
ranks (``freeze_step``, ``num_training_steps`` of ``set_run_length`` from a shard of another
length, ``exact_step_dtype``, ``local_step_clipper``, a rank resumed from another checkpoint)
pairs different collectives: gloo aborts the process ("Received data size doesn't match expected
size") or waits out its timeout (30 minutes by default), or the steps pair up silently and the
run ends with no error. A hyper-parameter that differs (``lr``, ``betas``, ``weight_decay``)
trains replicas that part, with no error at all.

So at its first step an optimizer of several ranks gathers a short vector of its settings from
every rank (:meth:`~hf_zeroone.comm.Communicator.gather_setup`: one all-gather of 384 bytes per
rank, once) and, where they differ, raises ``ValueError`` on every rank, naming each setting and
what each rank holds. Every rank sees the same rows, so every rank raises: none is left waiting.
Not caught: a DDP hook registered on some ranks only (the others' DDP allreduce and this check
wait for each other until the timeout), a checkpoint loaded on some ranks only (the loading ranks
wait here until the timeout), and a rank that skips a later ``step()`` (see
``check_replicas_every``).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

__all__ = ["check_ranks_agree", "settings"]

#: the length of the gathered vector, the same on every rank whatever its optimizer (padded)
FIELDS = 48

#: settings compared by a checksum (not a number a message could show)
_CHECKSUMS = {"optimizer class", "exact_step_dtype", "parameter shapes and dtypes", "every group's hyper-parameters"}


def _crc(value: Any) -> float:  # noqa: ANN401
    return float(zlib.crc32(repr(value).encode()))


def _group_values(group: dict[str, Any]) -> tuple:
    return (
        float(group["lr"]), float(group["betas"][0]), float(group["betas"][1]), float(group["eps"]),
        float(group["weight_decay"]), bool(group["bias_correction"]), bool(group["decoupled_weight_decay"]),
        len(group["params"]),
    )  # fmt: skip


def settings(opt: Any) -> list[tuple[str, float]]:  # noqa: ANN401 - a CompressedAdamBase
    """``(name, value)`` of each setting every rank must share, in a fixed order, as floats."""
    trainable = [p for _, p in opt.trainable_params()]
    out = [
        ("optimizer class", _crc(type(opt).__name__)),
        ("number of parameter groups", float(len(opt.param_groups))),
        ("number of trainable parameters", float(len(trainable))),
        ("parameter shapes and dtypes", _crc([(tuple(p.shape), str(p.dtype)) for p in trainable])),
        ("step counter (schedule['step'])", float(opt.schedule["step"])),
    ]
    out += [(name, -1.0 if v is None else float(v)) for name, v in opt._schedule_hyperparameters().items()]
    out += [
        ("exact_step_dtype", _crc(str(opt.exact_step_dtype))),
        ("follow_gradient_scale", float(opt.follow_gradient_scale)),
        ("clip_to_variance", float(opt.clip_to_variance)),
        ("auto_momentum_mask", float(opt.auto_momentum_mask)),
        ("check_replicas_every", float(opt.check_replicas_every)),
        ("every group's hyper-parameters", _crc([_group_values(g) for g in opt.param_groups])),
    ]
    names = ("lr", "betas[0]", "betas[1]", "eps", "weight_decay", "bias_correction", "decoupled_weight_decay")
    first = _group_values(opt.param_groups[0])
    out += [(f"{name} (group 0)", float(value)) for name, value in zip(names, first)]
    if len(out) > FIELDS:
        raise AssertionError(f"{len(out)} settings, more than the {FIELDS} gathered")
    return out


def check_ranks_agree(opt: Any) -> None:  # noqa: ANN401 - a CompressedAdamBase
    """Gather :func:`settings` from every rank; ``ValueError`` on every rank where any differs."""
    named = settings(opt)
    trainable = opt.trainable_params()
    values = torch.zeros(FIELDS, dtype=torch.float64)
    values[: len(named)] = torch.tensor([v for _, v in named], dtype=torch.float64)
    # NCCL gathers on the parameters' device (in step() the current CUDA device need not be theirs)
    rows = opt.comm.gather_setup(values, home=trainable[0][1].device if trainable else None)
    if bool((rows == rows[0]).all()):
        return
    if not bool((rows[:, 0] == rows[0, 0]).all()):  # other classes: the other fields do not line up
        differing = [_describe("optimizer class", rows[:, 0])]
    else:
        same = (rows == rows[0]).all(dim=0).tolist()
        differing = [_describe(name, rows[:, i]) for i, (name, _) in enumerate(named) if not same[i]]
    raise ValueError(
        f"hf_zeroone: the ranks built their {type(opt).__name__} differently (this is rank {opt.comm.rank}): "
        + "; ".join(differing)
        + ". Every rank must build the optimizer with the same arguments and parameters (the same "
        "num_training_steps in set_run_length or prepare_zeroone, even when the ranks' data shards differ "
        "in length) and resume from the same checkpoint: different settings make the ranks' collectives "
        "differ (an abort or a hang) or their replicas part."
    )


def _describe(name: str, column: torch.Tensor) -> str:
    """One differing setting: each rank's value, or which ranks differ from rank 0 for a checksum."""
    if name in _CHECKSUMS:
        ranks = [r for r in range(column.numel()) if column[r] != column[0]]
        return f"{name}: ranks {ranks} differ from rank 0"
    shown = [f"rank {r} has {_number(float(v))}" for r, v in enumerate(column.tolist())][:8]
    return f"{name}: " + ", ".join(shown)


def _number(v: float) -> str:
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)
