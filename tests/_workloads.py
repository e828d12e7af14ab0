"""Small models, data and training loops shared by the multi-process tests (imported in workers)."""

from __future__ import annotations

import torch


class MLP(torch.nn.Module):
    """A small MLP; optionally an embedding whose rows 1.. never get a gradient, and a layer never used."""

    def __init__(self, embedding_rows: int = 0, unused_layer: bool = False) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(16, 64),
            torch.nn.Tanh(),
            torch.nn.Linear(64, 33),
            torch.nn.Tanh(),
            torch.nn.Linear(33, 1),
        )
        self.extra = torch.nn.Embedding(embedding_rows, 1) if embedding_rows else None
        self.unused = torch.nn.Linear(3, 3) if unused_layer else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.extra is not None:
            out = out + self.extra(torch.zeros(x.shape[0], dtype=torch.long, device=x.device))
        return out


def make_model(seed: int = 0, embedding_rows: int = 0, unused_layer: bool = False) -> MLP:
    torch.manual_seed(seed)
    return MLP(embedding_rows, unused_layer)


def batches(rank: int, steps: int, batch: int = 64, seed: int = 100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable regression task; each rank draws its own samples."""
    g = torch.Generator().manual_seed(seed + rank)
    w = torch.linspace(-1, 1, 16)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=g)
        y = torch.sin(x @ w).unsqueeze(1) + 0.5 * x[:, :1] * x[:, 1:2]
        out.append((x, y))
    return out


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def eval_loss(model: torch.nn.Module, world: int, steps: int = 8) -> float:
    """Loss on held-out data drawn from every rank's distribution."""
    total = 0.0
    with torch.no_grad():
        for r in range(world):
            for x, y in batches(r, steps, seed=9000):
                total += loss_fn(model, x, y).item()
    return total / (world * steps)


def train_linear_target(forward, opt: torch.optim.Optimizer, rank: int, steps: int) -> list[float]:
    """``steps`` steps of regression onto a fixed linear map of 16 inputs to 4; each rank its own samples.

    ``forward(x, i)`` is the model's output at step ``i``. Warnings are silenced (``step()``
    communicating without a hook says so). Returns the losses.
    """
    import warnings

    gen = torch.Generator().manual_seed(1 + rank)
    target = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(steps):
            x = torch.randn(32, 16, generator=gen)
            loss = (forward(x, i) - x @ target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def hooked_default_run(name: str, steps: int):
    """``make_model()`` under DDP with the hook and ``name``'s optimizer ("onebit", "zeroone") on its
    defaults for a run of ``steps`` steps: ``(model, ddp_model, optimizer)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam, register_zeroone_hook

    model = make_model()
    ddp = DDP(model)
    opt = (OneBitAdam if name == "onebit" else ZeroOneAdam)(ddp.parameters(), lr=1e-2)
    opt.set_run_length(steps, 0)
    register_zeroone_hook(ddp, opt)
    return model, ddp, opt


def hook_test_optimizer(name, params, **kw):  # noqa: ANN001, ANN003, ANN201
    """The papers' maths unless told otherwise: exact steps in fp32, 0/1 Adam's 1-bit gradients from its second gap."""
    from hf_zeroone import OneBitAdam, ZeroOneAdam

    kw.setdefault("exact_step_dtype", "float32")
    if name == "onebit":
        return OneBitAdam(params, lr=1e-2, weight_decay=0.01, freeze_step=kw.pop("freeze_step", 3), **kw)
    return ZeroOneAdam(
        params,
        lr=1e-2,
        weight_decay=0.01,
        var_freeze_step=kw.pop("var_freeze_step", 12),
        var_update_scaler=2,
        local_step_scaler=3,
        local_step_clipper=4,
        **{"exact_warmup_steps": 0, **kw},
    )
