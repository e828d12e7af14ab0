r"""What the steps derive from each parameter's variance ``v``, computed once per version of ``v``.

While ``v`` is frozen (1-bit Adam after ``freeze_step``; 0/1 Adam between its variance updates
and after ``var_freeze_step``) every step needs the same values of it:

* the plain denominators :math:`d = \sqrt{v / c_2} + \epsilon`
  (:func:`._functional.denominators`, without the factor of ``follow_gradient_scale``): the
  update-unit weights of the 1-bit messages (:func:`._functional.to_update_units`) and the samples
  of ``follow_gradient_scale`` (:func:`._grad_scale.scale_samples`) are measured against them;
* per tensor, the mean of ``d`` and the count of the elements that take part in the samples
  (:func:`._grad_scale.sample_statistics`).

Computed afresh on every use, they would be a large part of a step's cost on a model of many
tensors (``recipes/bench_step.py`` times the step). :class:`VarianceViews` computes each once and
reuses it while it is valid: every value is keyed by the parameter, the identity and version
counter of its ``v`` (torch counts every in-place write to a tensor and to its views), ``c2`` and
``eps``. A variance update,
a checkpoint load or a changed ``eps`` recomputes it; nothing stale can be read.

Two lifetimes keep what the optimizer holds between steps as documented (:mod:`._memory`): the
full-size denominators are dropped when the step ends (:meth:`VarianceViews.release`); the
per-tensor statistics (a few floats per tensor) stay.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hf_zeroone.optim import _functional as F
from hf_zeroone.optim._grad_scale import sample_statistics

__all__ = ["SampleStatistics", "VarianceViews"]


_VERSION = operator.attrgetter("_version")


def _versions(ts: Sequence[Tensor]) -> list[int] | None:
    """The version counters of ``ts``; ``None`` if torch keeps none for one of them (nothing remembered then)."""
    try:
        return list(map(_VERSION, ts))
    except RuntimeError:
        return None


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _stands(
    known: tuple | None,
    params: Sequence[Tensor],
    vs: Sequence[Tensor],
    versions: list[int] | None,
    c2: float,
    eps: float,
) -> bool:
    """Whether a whole list's record ``(params, vs, versions, c2, eps, value)`` still holds for these arguments."""
    return (
        known is not None
        and versions is not None
        and known[2] == versions
        and known[3:5] == (c2, eps)
        and _same(known[0], params)
        and _same(known[1], vs)
    )


def _version(t: Tensor) -> int | None:
    """``t``'s version counter, or ``None`` where torch keeps none (inference tensors): never cached then."""
    try:
        return t._version
    except RuntimeError:
        return None


class SampleStatistics:
    """Per tensor of a list: its mean denominator, active count and whether any element is idle.

    ``idle`` is ``None`` until the end of a step that used the statistics and left ``v`` as it was
    (:meth:`VarianceViews.settle` reads it on the host there, once per version of ``v``); until
    then every tensor is masked. No hook reads the host.
    """

    def __init__(self, means: Tensor, counts: Tensor, idle: list[bool] | None, idle_eps: float = 0.0) -> None:
        self.means, self.counts, self.idle = means, counts, idle
        #: the ``eps`` at or below which an element's ``d`` is idle (:func:`._grad_scale.idle_floors`)
        self.idle_eps = idle_eps


class VarianceViews:
    """The denominators and sample statistics of each parameter's ``v``, while ``v`` is unchanged (see the module).

    The full-size denominators live from first use until :meth:`release` (at the end of a
    bucket's messages, and of the step); the per-tensor statistics stay while ``v`` does.
    """

    def __init__(self) -> None:
        self._dens: dict[int, tuple[Any, Tensor]] = {}
        #: id(p) -> [key, mean, count, idle on the device, idle read on the host or None]
        self._stats: dict[int, list] = {}
        #: the statistics last built for a whole list of parameters, by (id of its first, length, idle_eps):
        #: (params, vs, their versions, c2, eps, statistics). Checked at once (identities and version
        #: counters), a list's statistics cost far less than looking each tensor up and stacking.
        self._lists: dict[tuple[int, int, float], tuple] = {}
        #: the denominators last offered or computed for a whole list, by (id of its first, length):
        #: (params, vs, their versions, c2, eps, denominators), checked at once as ``_lists`` is; released with them
        self._dens_lists: dict[tuple[int, int], tuple] = {}

    @staticmethod
    def _key(v: Tensor, c2: float, eps: float) -> tuple:
        return (v, _version(v), c2, eps)  # v itself, compared by identity: an id can be reused

    def denominators(
        self, params: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], c2: float, eps: float
    ) -> list[Tensor]:
        """``sqrt(v / c2) + eps`` of each parameter (float32), reused until ``v`` changes or they are released."""
        known = self._dens_lists.get((id(params[0]), len(params))) if params else None
        if _stands(known, params, exp_avg_sqs, _versions(exp_avg_sqs), c2, eps):
            return list(known[5])
        keys = [self._key(v, c2, eps) for v in exp_avg_sqs]
        missing = [i for i, (p, key) in enumerate(zip(params, keys)) if self._valid(self._dens, p, key) is None]
        if missing:
            fresh = F.denominators(F.as_dtype([exp_avg_sqs[i] for i in missing], torch.float32), c2, eps)
            for i, d in zip(missing, fresh):
                if keys[i][1] is not None:
                    self._dens[id(params[i])] = (keys[i], d)
            if len(missing) == len(params):
                self._remember_list(params, exp_avg_sqs, c2, eps, fresh)
                return fresh
            by_index = dict(zip(missing, fresh))
            return [by_index[i] if i in by_index else self._dens[id(p)][1] for i, p in enumerate(params)]
        dens = [self._dens[id(p)][1] for p in params]
        self._remember_list(params, exp_avg_sqs, c2, eps, dens)
        return dens

    def _remember_list(
        self, params: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], c2: float, eps: float, dens: Sequence[Tensor]
    ) -> None:
        """Keep ``dens`` for the whole list (see ``_dens_lists``), where torch counts versions of every ``v``."""
        versions = _versions(exp_avg_sqs)
        if params and versions is not None:
            self._dens_lists[(id(params[0]), len(params))] = (
                list(params), list(exp_avg_sqs), versions, c2, eps, list(dens)
            )  # fmt: skip

    def offer(
        self, params: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], c2: float, eps: float, dens: Sequence[Tensor]
    ) -> None:
        """Keep ``dens``, computed elsewhere as :meth:`denominators` would, for ``params`` (until released)."""
        for p, v, d in zip(params, exp_avg_sqs, dens):
            key = self._key(v, c2, eps)
            if key[1] is not None:
                self._dens[id(p)] = (key, d)
        self._remember_list(params, exp_avg_sqs, c2, eps, dens)

    def statistics(
        self, params: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], c2: float, eps: float, idle_eps: float = 0.0
    ) -> tuple[list[Tensor], SampleStatistics]:
        """The denominators and their :class:`SampleStatistics`, for one parameter group's tensors in order.

        ``idle_eps``: elements whose ``d`` is not above it are idle (0: only the rule of the mean).
        """
        dens = self.denominators(params, exp_avg_sqs, c2, eps)
        slot, versions = (id(params[0]) if params else 0, len(params), idle_eps), _versions(exp_avg_sqs)
        known = self._lists.pop(slot, None)  # put back only while it stands: nothing stale is kept alive
        if _stands(known, params, exp_avg_sqs, versions, c2, eps):
            self._lists[slot] = known
            return dens, known[5]
        stats = self._statistics(params, exp_avg_sqs, c2, eps, idle_eps, dens)
        if versions is not None:
            self._lists[slot] = (list(params), list(exp_avg_sqs), versions, c2, eps, stats)
        return dens, stats

    def _statistics(
        self,
        params: Sequence[Tensor],
        exp_avg_sqs: Sequence[Tensor],
        c2: float,
        eps: float,
        idle_eps: float,
        dens: list[Tensor],
    ) -> SampleStatistics:
        keys = [(*self._key(v, c2, eps), idle_eps) for v in exp_avg_sqs]
        entries = [self._valid(self._stats, p, key) for p, key in zip(params, keys)]
        if any(e is None for e in entries):
            means, counts, idle = sample_statistics(dens, idle_eps)
            for p, key, mean, count, flag in zip(params, keys, means.unbind(), counts.unbind(), idle.unbind()):
                if key[1] is not None:
                    self._stats[id(p)] = [key, mean, count, flag, None]
            return SampleStatistics(means, counts, None, idle_eps)
        means = torch.stack([e[1] for e in entries])
        counts = torch.stack([e[2] for e in entries])
        read = [e[4] for e in entries]
        return SampleStatistics(means, counts, None if any(f is None for f in read) else read, idle_eps)

    def settle(self) -> None:
        """At the end of a step: read on the host which tensors have idle elements, for the statistics still valid.

        One host read, only when statistics were built this step and ``v`` did not change after
        (a variance update leaves them stale: nothing to read); later steps then skip the mask
        of every tensor with no idle element.
        """
        pending = [e for e in self._stats.values() if e[4] is None and e[0][1] == _version(e[0][0])]
        if pending:
            self._lists.clear()  # built while the flags were unknown: every tensor masked
            for e, flag in zip(pending, torch.stack([e[3] for e in pending]).tolist()):
                e[4] = bool(flag)

    def held(self) -> list[Tensor]:
        """Every tensor held now (for :func:`._memory.state_bytes`): none full-size between steps."""
        lists = [t for known in self._lists.values() for t in (known[5].means, known[5].counts)]
        listed = [d for known in self._dens_lists.values() for d in known[5]]
        return [d for _, d in self._dens.values()] + [t for e in self._stats.values() for t in e[1:4]] + lists + listed

    def release(self, params: Sequence[Tensor] | None = None) -> None:
        """Drop the full-size denominators of ``params`` (default: all); the per-tensor statistics stay."""
        self._dens_lists.clear()  # a list's record would keep the released ones alive
        if params is None:
            self._dens.clear()
            return
        for p in params:
            self._dens.pop(id(p), None)

    def clear(self) -> None:
        """Forget everything (a checkpoint was loaded)."""
        self._lists.clear()
        self._dens_lists.clear()
        self._dens.clear()
        self._stats.clear()

    @staticmethod
    def _valid(table: dict[int, Any], p: Tensor, key: tuple) -> Any:  # noqa: ANN401
        entry = table.get(id(p))
        if entry is None or key[1] is None:
            return None
        held = entry[0]
        return entry if held[0] is key[0] and held[1:] == key[1:] else None
