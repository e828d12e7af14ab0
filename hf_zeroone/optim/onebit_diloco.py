"""1-bit DiLoCo: local AdamW steps, the replicas' displacements averaged by the 1-bit allreduce every few steps.

DiLoCo (Douillard et al., https://arxiv.org/abs/2311.08105) lets each replica take ``H`` plain
optimizer steps alone, then averages the *pseudo-gradient*, the distance each replica moved since
the last sync, and applies it to the last synced parameters with an outer SGD (the paper: Nesterov
momentum 0.9, learning rate 0.7). This module sends each sync through the package's
error-compensated 1-bit allreduce (:meth:`hf_zeroone.Communicator.compressed_allreduce_async`)
instead of in fp32: about 1/32 of the bytes per sync, the compression error carried into the next
sync. Its defaults average the replicas every 4 steps (outer learning rate 1, no momentum): at
AdamW's best learning rate a run ends 0.7-1.2% above AdamW's loss (``docs/diloco.md``).

The state is flat, one buffer each over all trainable parameters in group order: the parameters
at the last sync (``anchor``), the outer momentum, and the two error-feedback buffers. The inner
optimizer is a :class:`torch.optim.AdamW` over the same parameter groups, so learning-rate
schedulers, gradient clipping and ``zero_grad`` act on it as on any optimizer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hf_zeroone.comm import CommStats, Communicator
from hf_zeroone.compression import ChunkLayout
from hf_zeroone.optim._step_kind import _check_int

__all__ = ["OneBitDiLoCo"]


class OneBitDiLoCo(torch.optim.Optimizer):
    r"""Local AdamW steps with 1-bit compressed DiLoCo syncs every ``sync_every`` steps (default: model averaging).

    Between syncs every rank runs :class:`torch.optim.AdamW` on its own gradients; nothing is
    sent (with DDP, :func:`hf_zeroone.register_zeroone_hook` replaces DDP's allreduce by a hook
    that returns the local gradients). At every ``sync_every``-th step, after the inner step,
    rank :math:`i` takes the outer Nesterov step of its own pseudo-gradient and the ranks average
    it through the error-compensated 1-bit allreduce :math:`\mathcal{C}`:

    .. math::
        \Delta_i = \theta_{\text{anchor}} - \theta_i, \quad
        b_i \leftarrow \mu b_i + \Delta_i, \quad
        \theta_{\text{anchor}} \leftarrow \theta_{\text{anchor}}
            - \eta_{\text{out}}\, \mathcal{C}\big[\Delta_i + \mu b_i\big], \quad
        \theta_i \leftarrow \theta_{\text{anchor}},

    with :math:`\mu` the outer momentum and :math:`\eta_{\text{out}}` the outer learning rate.
    Averaging is linear, so without compression this is DiLoCo's outer step of the averaged
    pseudo-gradient with the averaged momentum. Compressing the step rather than the
    pseudo-gradient puts each sync's compression error into the parameters once, and the error
    feedback takes it back at the next sync; compressed before the momentum, the error would
    pass through the momentum and reach the parameters about :math:`1 / (1 - \mu)` times.
    After a sync every replica holds bit-identical parameters; the inner AdamW states and the
    outer momentum stay per rank.

    The defaults (``outer_lr=1``, ``outer_momentum=0``) make a sync the average of the replicas'
    parameters: the method is AdamW whose replicas drift apart for ``sync_every - 1`` steps, and at
    AdamW's best learning rate it ends 0.7-1.2% above AdamW's loss (``docs/diloco.md``). The paper's outer step
    (``outer_lr=0.7, outer_momentum=0.9``) moves the anchor about :math:`\eta_{\text{out}} / (1 - \mu)`
    = 7 times each sync's average displacement: it pays at an inner learning rate below AdamW's
    best and overshoots at AdamW's own. ``sync_momentum=True`` also gives every rank the ranks'
    average update direction at each sync, so that the replicas drift apart less between syncs, for
    twice the bytes; at twice AdamW's learning rate it comes closest to AdamW (``docs/diloco.md``).

    Args:
        params: parameters or parameter groups, as for :class:`torch.optim.AdamW`.
        lr, betas, eps, weight_decay: the inner AdamW's (its defaults).
        sync_every: inner steps between syncs (``H``).
        outer_lr: the outer SGD's learning rate (1 with ``outer_momentum=0``, the defaults, is model
            averaging).
        outer_momentum: the outer SGD's Nesterov momentum (0: none).
        process_group: the data-parallel group (default: the default group, if initialised).
        communicator: a :class:`~hf_zeroone.Communicator` to use instead of a new one.
        scale_every: elements per scale of the 1-bit messages (each parameter's first block starts at
            its first element): each block is sent as signs times its root mean square.
        sync_passes: 1-bit allreduces per sync. Each pass after the first sends the signs of what the
            error buffers still hold, so a sync leaves less for the next one, for ``sync_passes`` times
            the bytes and collectives; it pays where one pass's error is large (with outer momentum).
        sync_momentum: at every sync also give every rank's inner AdamW the ranks' average update
            direction (its first moment averaged in update units), sent through the same 1-bit
            allreduce with its own error feedback: twice the bytes and collectives of a sync, 4 more
            bytes of state per parameter.
        check_replicas_every: at the first sync at or after every multiple of this many steps,
            check that the replicas hold bit-identical parameters (0: never); the first step
            checks that they start identical.
        foreach, fused: passed to the inner AdamW; ``fused=None`` means fused when every
            parameter is on a CUDA device.

    Example::

        opt = OneBitDiLoCo(model.parameters(), lr=1e-3)
        for batch in loader:
            model(**batch).loss.backward()
            opt.step(); opt.zero_grad()
        opt.synchronize()   # one model on every rank after the last step

    Replicas differ between syncs: call :meth:`synchronize` on every rank before evaluating or
    saving the model (``ZeroOneTrainer`` and ``prepare_zeroone`` do). fp16 with a ``GradScaler``
    is not supported: a step skipped on one rank only would put the ranks' syncs on different
    iterations; use bf16.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        sync_every: int = 4,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        process_group: dist.ProcessGroup | None = None,
        communicator: Communicator | None = None,
        check_replicas_every: int = 100,
        scale_every: int = 256,
        sync_passes: int = 1,
        sync_momentum: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        _check_int("sync_every", sync_every, 1)
        _check_int("check_replicas_every", check_replicas_every, 0)
        _check_int("scale_every", scale_every, 8)
        _check_int("sync_passes", sync_passes, 1)
        if not (math.isfinite(outer_lr) and outer_lr > 0):
            raise ValueError(f"outer_lr must be a positive number, got {outer_lr}")
        if not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if fused is None and trainable and all(p.is_cuda and p.is_floating_point() for p in trainable):
            fused = True
        # the inner AdamW keeps the same group dicts: a scheduler or clipper that sets lr here sets it there
        self.inner = torch.optim.AdamW(self.param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                       foreach=foreach, fused=fused)  # fmt: skip
        self.state = self.inner.state
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, outer_lr, outer_momentum
        self.check_replicas_every, self.scale_every, self.sync_passes = check_replicas_every, scale_every, sync_passes
        self.sync_momentum = bool(sync_momentum)
        self.comm = communicator if communicator is not None else Communicator(process_group)
        self.local_steps = 0  # inner steps taken
        self.syncs = 0
        self.steps_since_sync = 0
        self._checked_at = -1  # the step // check_replicas_every of the last replica check
        self._flat: dict[str, Tensor] | None = None  # built at the first step, from the parameters then

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_flat", None) is not None:
            raise ValueError("OneBitDiLoCo: add parameter groups before the first step (the flat state is built)")
        super().add_param_group(param_group)
        if hasattr(self, "inner"):
            self.inner.add_param_group(self.param_groups[-1])

    @property
    def comm_stats(self) -> CommStats:
        """Bytes and collectives this rank has sent (the syncs; the replica checks apart)."""
        return self.comm.stats

    @property
    def in_sync(self) -> bool:
        """Whether every replica holds the same parameters now: before the first step or right after a sync."""
        return self.steps_since_sync == 0

    def trainable_params(self) -> list[Tensor]:
        """The parameters that take part, in group order: those with ``requires_grad``."""
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _build(self) -> dict[str, Tensor]:
        params = self.trainable_params()
        if len({p.device for p in params}) > 1:
            raise ValueError("OneBitDiLoCo keeps one flat state: every parameter must be on one device")
        device = params[0].device if params else torch.device("cpu")
        sizes = [p.numel() for p in params]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        starts += [b for s, n in zip(starts, sizes) for b in range(s + self.scale_every, s + n, self.scale_every)]
        layout = ChunkLayout.from_mask(sum(sizes), self.comm.world_size, device=device, segment_starts=starts)
        flat = torch.zeros(layout.padded, dtype=torch.float32, device=device)
        if params:
            torch.cat([p.detach().reshape(-1).float() for p in params], out=flat[: layout.numel])
        self._layout, self._sizes = layout, sizes
        n_momentum = (layout.padded, layout.chunk) if self.sync_momentum else (0, 0)
        return {
            "anchor": flat[: layout.numel],
            # none without outer momentum (the default): 4 bytes per parameter saved
            "momentum": torch.zeros(layout.numel if self.outer_momentum else 0, dtype=torch.float32, device=device),
            "worker_error": torch.zeros(layout.padded, dtype=torch.float32, device=device),
            "server_error": torch.zeros(layout.chunk, dtype=torch.float32, device=device),
            # the inner first moment's own error feedback (only with sync_momentum)
            "momentum_worker_error": torch.zeros(n_momentum[0], dtype=torch.float32, device=device),
            "momentum_server_error": torch.zeros(n_momentum[1], dtype=torch.float32, device=device),
        }

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One inner AdamW step; a 1-bit sync after every ``sync_every``-th."""
        if self._flat is None:
            self._flat = self._build()
            self.comm.assert_identical(self.trainable_params(), "initial parameters (seed every rank alike)")
        with torch.enable_grad():
            loss = self.inner.step(closure)
        self.local_steps += 1
        self.steps_since_sync += 1
        if self.steps_since_sync >= self.sync_every:
            self._sync()
        return loss

    @torch.no_grad()
    def synchronize(self) -> bool:
        """Sync now (a collective: call it on every rank): one model on every rank, e.g. after the last step.

        Returns whether it synced (``False`` right after a sync or in a one-process run).
        """
        if self._flat is None or self.steps_since_sync == 0 or not self.comm.is_distributed:
            return False
        self._sync()
        return True

    def _sync(self) -> None:
        flat, layout, params = self._flat, self._layout, self.trainable_params()
        self.steps_since_sync = 0
        if not self.comm.is_distributed:
            return  # one replica: the anchor is not needed, the parameters are the model
        message = torch.zeros(layout.padded, dtype=torch.float32, device=flat["anchor"].device)
        step = message[: layout.numel]
        torch.cat([p.detach().reshape(-1).float() for p in params], out=step)
        torch.sub(flat["anchor"], step, out=step)  # the pseudo-gradient: how far this replica moved
        if self.outer_momentum > 0:  # this rank's Nesterov step, from its own momentum
            flat["momentum"].mul_(self.outer_momentum).add_(step)
            step.add_(flat["momentum"], alpha=self.outer_momentum)
        errors = flat["worker_error"], flat["server_error"]
        averaged = self.comm.compressed_allreduce(message, *errors, layout)
        for _ in range(self.sync_passes - 1):  # each further pass sends the signs of what the error buffers hold
            averaged.add_(self.comm.compressed_allreduce(torch.zeros_like(message), *errors, layout))
        step = averaged[: layout.numel]  # identical on every rank (in message's memory)
        if not bool(torch.isfinite(step).all()):
            raise FloatingPointError(
                "OneBitDiLoCo: a replica's parameters are not finite at this sync (the inner steps diverged); "
                "lower the learning rate or clip the gradients, and restart from the last checkpoint"
            )
        flat["anchor"].sub_(step, alpha=self.outer_lr)
        views = [v.view_as(p) for v, p in zip(flat["anchor"].split(self._sizes), params)]
        torch._foreach_copy_(params, views)
        if self.sync_momentum:
            self._average_inner_momentum(params)
        self.syncs += 1
        every = self.check_replicas_every
        if every and self.local_steps // every != self._checked_at:
            self._checked_at = self.local_steps // every
            self.comm.assert_identical(params, step=self.local_steps)

    def _average_inner_momentum(self, params: list[Tensor]) -> None:
        """Give every rank's inner AdamW the ranks' average update direction, through the 1-bit allreduce.

        Averaged in update units, ``m / (sqrt(v) + eps)`` (each rank's own first and second moments): a
        block's signs times its root mean square keep every element's update within the block's size,
        where 1-bit first moments divided by a second moment near zero (a token never seen) would not.
        Each rank's first moment becomes the average times its own denominator; a parameter without a
        gradient yet sends zeros and keeps no moment.
        """
        flat, layout = self._flat, self._layout
        message = torch.zeros(layout.padded, dtype=torch.float32, device=flat["anchor"].device)
        held = [(p, self.inner.state[p]) for p in params if "exp_avg" in self.inner.state.get(p, {})]
        if held:
            eps = {id(p): g["eps"] for g in self.param_groups for p in g["params"]}
            denominators = torch._foreach_sqrt([s["exp_avg_sq"].float() for _, s in held])
            torch._foreach_add_(denominators, [eps[id(p)] for p, _ in held])
            views = dict(zip(map(id, params), message[: layout.numel].split(self._sizes)))
            units = [views[id(p)].view_as(p) for p, _ in held]
            torch._foreach_copy_(units, [s["exp_avg"] for _, s in held])
            torch._foreach_div_(units, denominators)
        errors = flat["momentum_worker_error"], flat["momentum_server_error"]
        averaged = self.comm.compressed_allreduce(message, *errors, layout)[: layout.numel]
        if held:
            views = dict(zip(map(id, params), averaged.split(self._sizes)))
            moments = [views[id(p)].view_as(p) for p, _ in held]
            torch._foreach_mul_(moments, denominators)
            torch._foreach_copy_([s["exp_avg"] for _, s in held], moments)

    def state_dict(self) -> dict[str, Any]:
        flat = {k: v.clone() for k, v in (self._flat or {}).items()}
        counters = {"local_steps": self.local_steps, "syncs": self.syncs, "steps_since_sync": self.steps_since_sync}
        return {"inner": self.inner.state_dict(), "outer": {**flat, **counters, "world_size": self.comm.world_size}}

    def defer_rank_state(self, state_dict: dict[str, Any]) -> None:
        """Make the next :meth:`load_state_dict` load ``state_dict`` instead of the state it is given
        (for frameworks that hand every rank the state rank 0 saved: each rank keeps its own)."""
        self._deferred_state = state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; saved on another number of ranks, the error buffers start from zero."""
        deferred, self._deferred_state = getattr(self, "_deferred_state", None), None
        state_dict = deferred if deferred is not None else state_dict
        if set(state_dict) != {"inner", "outer"}:
            raise ValueError("not a OneBitDiLoCo state_dict: it needs the keys 'inner' and 'outer'")
        outer = state_dict["outer"]
        self.inner.load_state_dict(state_dict["inner"])
        # torch gives the inner AdamW new group dicts and a new state: take their values into the shared
        # groups, so that a scheduler setting lr on param_groups still drives the inner AdamW
        for mine, loaded in zip(self.param_groups, self.inner.param_groups):
            mine.update({k: v for k, v in loaded.items() if k != "params"})
        self.inner.param_groups, self.state = self.param_groups, self.inner.state
        self.local_steps, self.syncs = outer["local_steps"], outer["syncs"]
        self.steps_since_sync = outer["steps_since_sync"]
        if "anchor" not in outer:
            self._flat = None
            return
        self._flat = self._build()
        keys = ("anchor",)
        if self.outer_momentum and outer["momentum"].numel():  # else this run's momentum starts from zero
            keys += ("momentum",)
        if outer["world_size"] == self.comm.world_size:
            keys += ("worker_error", "server_error")
            if self.sync_momentum and outer.get("momentum_worker_error", torch.empty(0)).numel():
                keys += ("momentum_worker_error", "momentum_server_error")
        else:
            warnings.warn(f"OneBitDiLoCo: this state was saved on {outer['world_size']} ranks and the group has "
                          f"{self.comm.world_size}; the error feedback starts from zero", stacklevel=2)  # fmt: skip
        for key in keys:
            if self._flat[key].shape != outer[key].shape:
                raise ValueError(f"the saved {key} has {outer[key].numel()} elements, these parameters "
                                 f"{self._flat[key].numel()}: load it into the model it was saved from")  # fmt: skip
            self._flat[key].copy_(outer[key])
