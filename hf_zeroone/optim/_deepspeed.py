"""DeepSpeed configs in: the ``"optimizer"`` section of a DeepSpeed config as a hf_zeroone optimizer.

DeepSpeed removed ``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb`` in 0.19.7 (PR #8490); 0.19.8
rejects ``"type": "OneBitAdam"``. A config that holds ::

    {"optimizer": {"type": "OneBitAdam" | "ZeroOneAdam", "params": {...}}}

loads here with :func:`from_deepspeed_config`. Every parameter DeepSpeed's two optimizers accepted
maps to its namesake, or is accepted with a one-line note where it has no meaning here
(``cuda_aware``, ``comm_backend_name``) or did nothing in DeepSpeed either (``eps_inside_sqrt``,
``max_grad_norm``). Defaults that differ from DeepSpeed's (bias correction, bf16 exact steps, 0/1
Adam's exact phase 1) get a note too, unless the caller sets them. What cannot be honoured
(``amsgrad``, 1-bit LAMB, an unknown parameter, a value left ``"auto"`` with nothing to fill it)
raises ``ValueError`` naming the fix. The semantic
differences, and what to change to reproduce an old run, are in ``docs/migrating_from_deepspeed.md``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor

from hf_zeroone._warnings import user_stacklevel
from hf_zeroone.optim._base import CompressedAdamBase
from hf_zeroone.optim.onebit_adam import OneBitAdam
from hf_zeroone.optim.zeroone_adam import ZeroOneAdam

__all__ = ["DeepSpeedConfigNote", "deepspeed_optimizer_section", "from_deepspeed_config"]


class DeepSpeedConfigNote(UserWarning):
    """A DeepSpeed config entry that is accepted but has no effect here (one line, with the reason)."""


_COMMON = ("lr", "betas", "eps", "weight_decay", "bias_correction")
_SCHEDULE = {
    "onebitadam": (OneBitAdam, ("freeze_step",)),
    "zerooneadam": (ZeroOneAdam, ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")),
}
#: accepted, with no effect here (nor, for the last two, in DeepSpeed's update): why
_NOTES = {
    "cuda_aware": "hf_zeroone communicates through torch.distributed (gloo or NCCL), never through MPI",
    "comm_backend_name": "hf_zeroone uses the backend of the torch.distributed process group",
    "eps_inside_sqrt": "DeepSpeed's 1-bit optimizers stored it but always added eps outside the square root, as here",
    "max_grad_norm": "DeepSpeed's 1-bit optimizers ignored it; clip in the training loop (the Trainer's "
    "max_grad_norm, accelerator.clip_grad_norm_)",
}


def deepspeed_optimizer_section(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """The ``"optimizer"`` section of a DeepSpeed config (a dict, or the path of a JSON file)."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"DeepSpeed config {os.fspath(config)!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config {os.fspath(config)!r} is not valid JSON: {e}") from None
    if not isinstance(config, Mapping) or not isinstance(config.get("optimizer"), Mapping):
        raise ValueError(
            'a DeepSpeed config needs an "optimizer" section: {"optimizer": {"type": ..., "params": {...}}}'
        )
    section = dict(config["optimizer"])
    section.setdefault("params", {})
    if "gradient_clipping" in config and config["gradient_clipping"] not in (0, 0.0, "auto", None):
        _note(
            "gradient_clipping",
            "it was DeepSpeed's engine's, not the optimizer's: pass max_grad_norm to the Trainer or clip in your loop",
        )
    return section


def _note(name: str, why: str) -> None:
    warnings.warn(
        f"DeepSpeed config: {name} is accepted with no effect: {why}", DeepSpeedConfigNote, stacklevel=user_stacklevel()
    )


def _differs(what: str, why: str) -> None:
    warnings.warn(
        f"DeepSpeed config: {what} differs from DeepSpeed's: {why}", DeepSpeedConfigNote, stacklevel=user_stacklevel()
    )


def optimizer_kwargs(
    section: Mapping[str, Any], auto: Mapping[str, Any] | None = None, given: Iterable[str] = ()
) -> tuple[type, dict[str, Any]]:
    """The hf_zeroone class and keyword arguments of a DeepSpeed ``"optimizer"`` section.

    ``auto`` fills the values the config leaves ``"auto"`` (the Hugging Face convention: lr, betas,
    eps, weight_decay from ``TrainingArguments``). ``given``: the options the caller sets beside the
    config; a default that differs from DeepSpeed's is noted only when it is not among them.
    """
    kind = str(section.get("type", "")).replace("_", "").lower()
    if kind == "onebitlamb":
        raise ValueError(
            "1-bit LAMB (DeepSpeed's OneBitLamb) is not implemented in hf_zeroone; use OneBitAdam or ZeroOneAdam "
            '("type": "OneBitAdam" | "ZeroOneAdam")'
        )
    if kind not in _SCHEDULE:
        raise ValueError(
            f"DeepSpeed optimizer type {section.get('type')!r} is not a 1-bit optimizer: this loader maps "
            '"OneBitAdam" and "ZeroOneAdam" (for Adam or AdamW use torch.optim.AdamW directly)'
        )
    cls, schedule = _SCHEDULE[kind]
    params = dict(section.get("params") or {})
    if params.pop("amsgrad", False):
        raise ValueError(
            f"amsgrad: {cls.__name__} freezes the variance, so AMSGrad has no meaning (DeepSpeed refused it too)"
        )
    kwargs: dict[str, Any] = {}
    for name in list(params):
        value = params.pop(name)
        if name in _NOTES:
            if name in ("cuda_aware", "comm_backend_name") or value not in (False, 0, 0.0, None):
                _note(f"{name}={value!r}", _NOTES[name])
            continue
        if name not in _COMMON + schedule:
            raise ValueError(
                f"DeepSpeed {section.get('type')} parameter {name!r} is unknown; {cls.__name__} takes "
                f"{', '.join(_COMMON + schedule + tuple(_NOTES))}"
            )
        if value == "auto":
            if not auto or name not in auto:
                raise ValueError(
                    f'DeepSpeed config: {name} is "auto" and nothing fills it here; give a value (or use '
                    "ZeroOneTrainingArguments(from_deepspeed_config=...), which fills lr, betas, eps and weight_decay)"
                )
            value = auto[name]
        kwargs[name] = tuple(value) if name == "betas" else value
    given = set(given)
    if "bias_correction" not in kwargs or kwargs["bias_correction"]:
        kwargs.pop("bias_correction", None)  # on by default here
        if "bias_correction" not in given:
            _note(
                "bias_correction (true or unset)",
                "DeepSpeed never applied it; hf_zeroone corrects by default (set it to false to reproduce an old run)",
            )
    if "exact_step_dtype" not in given:
        _differs(
            "the exact steps' precision",
            "hf_zeroone averages fp32 gradients as float8 messages by default, a quarter of the bytes; DeepSpeed "
            "sent them in fp32 "
            "(pass exact_step_dtype=torch.float32, or --exact_step_dtype float32, to reproduce an old run)",
        )
    if cls is ZeroOneAdam and "exact_warmup_steps" not in given:
        _differs(
            "0/1 Adam's phase 1",
            "every step before var_freeze_step is exact here by default; DeepSpeed sent 1-bit gradients between its "
            "variance steps (pass exact_warmup_steps=0 to reproduce an old run)",
        )
    return cls, kwargs


def from_deepspeed_config(
    params: Iterable[Tensor] | Iterable[dict[str, Any]],
    config: str | os.PathLike | Mapping[str, Any],
    **overrides: Any,
) -> CompressedAdamBase:
    """Build the hf_zeroone optimizer a DeepSpeed config describes (``OneBitAdam`` or ``ZeroOneAdam``).

    Args:
        params: the parameters or parameter groups, as for any ``torch.optim`` optimizer.
        config: a DeepSpeed config dict, or the path of one as JSON; only its ``"optimizer"``
            section (and a note on ``gradient_clipping``) is read.
        overrides: keyword arguments of the optimizer that win over the config, and fill values
            the config leaves ``"auto"`` (e.g. ``lr=3e-4``); any hf_zeroone option works
            (``follow_gradient_scale=False``, ``process_group=...``).

    Schedule settings the config leaves out follow the run length, given later with
    :meth:`~hf_zeroone.optim.CompressedAdamBase.set_run_length` (DeepSpeed's own defaults, a freeze
    at step 100000 and ``local_step_scaler=32678``, meant no compression in most runs).
    """
    cls, kwargs = optimizer_kwargs(deepspeed_optimizer_section(config), auto=overrides, given=overrides)
    # DeepSpeed's default; the classes default to torch.optim.AdamW's 1e-2. (The Trainer's path takes
    # its own --weight_decay, 0.0 by default, for a config that leaves it out.)
    kwargs.setdefault("weight_decay", 0.0)
    kwargs.update(overrides)
    return cls(params, **kwargs)
