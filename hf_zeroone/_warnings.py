"""Warnings that point at the user's line, whatever wraps the call (torch, Accelerate, the Trainer)."""

from __future__ import annotations

import os
import sys
import types

__all__ = ["user_stacklevel"]


def user_stacklevel() -> int:
    """``stacklevel`` that points a warning raised by this module's caller at the user's code.

    Skips the frames of torch, hf_zeroone, accelerate and transformers (their wrappers around
    ``step()`` differ between versions) and the ``__init__`` that ``dataclasses`` generates for
    the training arguments (file ``<string>``); level 1 is the caller of this function.
    """
    skip = tuple(
        os.path.dirname(module.__file__) + os.sep
        for name in ("torch", "hf_zeroone", "accelerate", "transformers")
        if (module := sys.modules.get(name)) is not None and getattr(module, "__file__", None)
    )
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(skip) or _generated_init(frame)):
        frame, level = frame.f_back, level + 1
    return level


def _generated_init(frame: types.FrameType) -> bool:
    """Whether ``frame`` runs a dataclass's generated ``__init__`` (it has no file; it calls ``__post_init__``)."""
    return frame.f_code.co_filename == "<string>" and frame.f_code.co_name == "__init__"
