"""A checkpoint written by hf_zeroone 0.1.0 loads and resumes training.

``tests/fixtures/checkpoint_0.1.0/`` holds, per optimizer and rank, the model and optimizer state
of a 2-rank DDP run with the hook, saved in the compressed phase (1-bit Adam's momentum steps,
0/1 Adam's local phase after a sync), and the losses that release reached over the next steps.
It was made by that release with ``python tests/test_checkpoint_fixture.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_0.1.0"
STEPS_BEFORE, STEPS_AFTER = 12, 8
SCHEDULES = {
    "onebit": {"freeze_step": 4},
    "zeroone": {"var_freeze_step": 6, "local_step_scaler": 2, "local_step_clipper": 4, "exact_warmup_steps": 2},
}


def _run(rank: int, world: int, name: str, folder: str, load: bool) -> dict:
    """Train ``STEPS_BEFORE`` steps and save (``load=False``), or load and train ``STEPS_AFTER`` more."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zeroone import OneBitAdam, ZeroOneAdam, register_zeroone_hook

    from _workloads import batches, flat_params, loss_fn, make_model

    model = make_model()
    path = Path(folder) / f"{name}_rank{rank}.pt"
    saved = torch.load(path, weights_only=False) if load else None
    if saved is not None:
        model.load_state_dict(saved["model"])
    ddp = DDP(model)
    opt = (OneBitAdam if name == "onebit" else ZeroOneAdam)(ddp.parameters(), lr=1e-2, **SCHEDULES[name])
    register_zeroone_hook(ddp, opt)
    restored = None
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])
        before = saved["optimizer"]["state"]
        restored = [
            torch.equal(opt.state[p][key].reshape(-1), before[i][key].reshape(-1))
            for i, p in enumerate(model.parameters())
            for key in ("exp_avg", "exp_avg_sq", "worker_error")
            if key in before[i]
        ]
    data = batches(rank, STEPS_BEFORE + STEPS_AFTER)
    out = {"rank": rank, "step_at_start": opt.schedule["step"], "restored": restored, "losses": [], "kinds": []}
    for x, y in data[STEPS_BEFORE:] if load else data[:STEPS_BEFORE]:
        opt.zero_grad()
        loss = loss_fn(ddp, x, y)
        loss.backward()
        opt.step()
        out["losses"].append(float(loss))
        out["kinds"].append(opt.last_step_kind.value)
    opt.synchronize()  # one model on every rank (0/1 Adam's local phase)
    out["params"] = flat_params(model)
    if not load:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return out


@pytest.mark.parametrize("name", ["onebit", "zeroone"])
def test_a_checkpoint_of_release_0_1_0_loads_and_resumes_training(name):
    from _dist import run_ranks

    expected = json.loads((FIXTURE / "continued.json").read_text())[name]
    ranks = run_ranks(_run, 2, name, str(FIXTURE), True, timeout=180)
    for out in ranks:
        assert out["step_at_start"] == STEPS_BEFORE  # the schedule came back with the state
        assert out["restored"] and all(out["restored"])  # moments and this rank's error buffers, as saved
        assert out["kinds"] == expected["kinds"]  # the compressed phase goes on where it was
        # the same trajectory within the bits the order of operations may change
        want = torch.tensor(expected["losses"][out["rank"]])
        torch.testing.assert_close(torch.tensor(out["losses"]), want, rtol=0.05, atol=0)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])  # replicas identical after the sync
    loaded = torch.load(FIXTURE / f"{name}_rank0.pt", weights_only=False)["optimizer"]
    errors = [s["worker_error"] for s in loaded["state"].values() if "worker_error" in s]
    assert errors and any(bool(e.abs().sum() > 0) for e in errors)  # error feedback was saved, not zeros


def _make_fixture() -> None:
    """Write the fixture with the installed release: the checkpoints, then the losses it reaches from them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _dist import run_ranks

    FIXTURE.mkdir(parents=True, exist_ok=True)
    continued = {}
    for name in SCHEDULES:
        run_ranks(_run, 2, name, str(FIXTURE), False, timeout=180)
        ranks = run_ranks(_run, 2, name, str(FIXTURE), True, timeout=180)
        continued[name] = {"kinds": ranks[0]["kinds"], "losses": [r["losses"] for r in ranks]}
    (FIXTURE / "continued.json").write_text(json.dumps(continued, indent=1) + "\n")


if __name__ == "__main__":
    _make_fixture()
