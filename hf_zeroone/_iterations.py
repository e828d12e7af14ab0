"""How the DDP hook tells one iteration from the next: backward passes of one step, and a new step.

Two questions the hook (:mod:`hf_zeroone.ddp_hook`) cannot answer from the bucket alone:

* **Is this backward pass one of several before one ``step()``?** A loop that accumulates
  gradients without ``no_sync()`` makes DDP call the hook on every pass. :class:`BackwardPasses`
  counts the calls per bucket within a step (keyed by the optimizer's step and its
  ``grad_generation``, which ``step()`` and ``zero_grad()`` advance) and learns the number of
  passes per step, so that only the last one is combined, as under ``no_sync()``.
* **Are the results in ``p.grad`` still this iteration's?** After a step that was not taken (a
  GradScaler skip), an iteration whose micro-steps all run under ``no_sync()`` must communicate
  in ``step()``: :func:`forget_results_on_next_backward` forgets the hook's results once a backward
  pass reaches the outputs of a later forward, and only then (a prediction logged under
  ``no_grad()`` between backward and ``step()`` changes nothing).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

__all__ = ["PASSES_KEY", "BackwardPasses", "forget_results_on_next_backward"]

#: the optimizer's schedule entry that holds the learned passes per step: saved in its checkpoints,
#: so a resumed run combines once per step from its first step
PASSES_KEY = "backward_passes_per_step"

#: steps in a row with fewer passes than learned after which the hook takes the new count
_SHORT_STEPS_TO_RELEARN = 3


class BackwardPasses:
    """Counts the hook's calls per bucket in each step; learns the backward passes per step.

    The count (:func:`known`) is ``None`` until a bucket is called again after it was combined in
    the same step (gradient accumulation without ``no_sync()``). That step is left to ``step()``
    (the passes before were combined already), its passes are counted, and from the next step on
    the first ``known - 1`` passes are handed back as they are and the last is combined. The count
    is kept in the optimizer's schedule (:data:`PASSES_KEY`), so its checkpoints carry it. A step with fewer
    passes (an epoch's end) is left to ``step()``; three such steps in a row set the count anew
    (1: no accumulation). A GradScaler's ``update()`` between two passes (its scale tensor's
    version counter moved, read on the host without a device sync) marks a skipped step: the next
    pass starts a new iteration.
    """

    def __init__(self) -> None:
        self._key: tuple = ()
        self._calls: dict[int, int] = {}
        self._learning = False
        self._scaler_version: tuple[int, int] | None = None
        self._short_steps = 0
        self._warned = False

    def hands_back(self, optimizer, grad_scaler, bucket_index: int) -> bool:  # noqa: ANN001
        """Whether this call hands its bucket back uncombined (see the class); counts the call."""
        key = (optimizer.schedule["step"], optimizer.grad_generation)
        version = _scaler_version(grad_scaler)
        if key != self._key:
            self._close_step(optimizer)
            self._key, self._calls, self._learning, self._scaler_version = key, {}, False, version
        elif version != self._scaler_version:  # the scaler updated: that step was skipped
            self._calls, self._learning, self._scaler_version = {}, False, version
        count = self._calls[bucket_index] = self._calls.get(bucket_index, 0) + 1
        passes = known(optimizer)
        if passes is not None:  # (learned here, or loaded with a checkpoint)
            optimizer.hook_defers_some_steps = True
        if self._learning:
            _set_known(optimizer, max(count, passes or 0))
            return True
        if passes is not None and count < passes:
            return True
        if count == 1 or count == passes:
            return False
        self._learning = True  # combined once already this step: the passes accumulate
        optimizer.hook_defers_some_steps = True
        _set_known(optimizer, count)  # so far: a checkpoint after this step holds the whole count
        if not self._warned:
            self._warned = True
            warnings.warn(
                "hf_zeroone: DDP called the communication hook again before optimizer.step() (gradient "
                "accumulation without no_sync()). From the next step on the hook combines the gradients "
                "once per step, on the last backward pass, as under no_sync(); this step, and any step "
                "with fewer passes, communicates in step(). Wrap the earlier micro-steps in "
                "ddp_model.no_sync() (Accelerate: accelerator.accumulate(model)) to say so directly. If a "
                "GradScaler skipped the step instead, pass it to the hook: "
                "register_zeroone_hook(..., grad_scaler=scaler).",
                UserWarning,
                stacklevel=3,
            )
        return True

    def _close_step(self, optimizer) -> None:  # noqa: ANN001
        passes, learned = max(self._calls.values(), default=0), known(optimizer)
        if self._learning:  # its count is in the schedule already (hands_back wrote it)
            self._short_steps = 0
        elif learned is not None and 0 < passes < learned:
            self._short_steps += 1
            if self._short_steps >= _SHORT_STEPS_TO_RELEARN:  # the loop accumulates fewer passes now
                _set_known(optimizer, None if passes == 1 else passes)
                self._short_steps = 0
                optimizer.hook_defers_some_steps = passes > 1
        elif passes:
            self._short_steps = 0


def known(optimizer) -> int | None:  # noqa: ANN001
    """The backward passes per step the hook learned for ``optimizer`` (``None``: one, or not seen yet)."""
    return optimizer.schedule.get(PASSES_KEY)


def _set_known(optimizer, passes: int | None) -> None:  # noqa: ANN001
    if passes is None:
        optimizer.schedule.pop(PASSES_KEY, None)
    else:
        optimizer.schedule[PASSES_KEY] = passes


def _scaler_version(grad_scaler) -> tuple[int, int] | None:  # noqa: ANN001
    """An enabled GradScaler's scale tensor and its version counter (each ``update()`` writes it), or ``None``."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return None
    scale = getattr(grad_scaler, "_scale", None)
    return (id(scale), scale._version) if isinstance(scale, Tensor) else None


def forget_results_on_next_backward(forget: Callable[[], None]):  # noqa: ANN201 - a forward hook
    """A forward hook that calls ``forget()`` when a backward pass reaches the forward's outputs.

    An output it cannot look into (:func:`tensors_in` finds no tensor) calls it at once, at every
    forward. Each tensor gets one hook however often it is returned.
    """
    hooked: dict[int, weakref.ref] = {}  # id -> the tensor (a WeakSet would compare tensors by value)

    def on_gradient(_grad: Tensor) -> None:
        forget()

    def post_hook(module: torch.nn.Module, args: tuple, output: object) -> None:
        tensors = tensors_in(output)
        if not tensors:
            forget()
        for t in tensors:
            key = id(t)
            held = hooked.get(key)
            if t.grad_fn is not None and (held is None or held() is not t):  # a leaf's hooks would stay for good
                t.register_hook(on_gradient)
                hooked[key] = weakref.ref(t, lambda _, key=key: hooked.pop(key, None))

    return post_hook


def tensors_in(output: object, depth: int = 0) -> list[Tensor]:
    """The tensors of a forward's output: itself, or inside tuples (``torch.return_types`` too), lists, mappings."""
    if isinstance(output, Tensor):
        return [output]
    if depth > 3:
        return []
    if isinstance(output, (tuple, list)):
        items = list(output)
    elif isinstance(output, Mapping):  # a transformers ModelOutput is an OrderedDict
        items = list(output.values())
    else:
        return []
    return [t for item in items for t in tensors_in(item, depth + 1)]
