"""A fingerprint of both optimizers' arithmetic: did a change move a bit of what they compute?

Runs short one-process trainings of 1-bit Adam and 0/1 Adam on the small BERT of
``recipes/bench_step.py``, through every phase of their schedules (exact steps, 1-bit steps, 0/1
Adam's variance updates, local steps and syncs, with and without ``clip_to_variance``), on fixed
random gradients that leave half of the word embedding's rows out for the first half of the run
(masked rows, then released), and prints one hash per run of the parameters and of every tensor
of the optimizer's state. A change meant to leave the results alone (a faster
kernel, a different bookkeeping) prints the same hashes before and after::

    python tests/_state_hash.py            # on the change
    git stash; python tests/_state_hash.py; git stash pop   # before it

One process only: the 1-bit compression itself is left to the two-rank tests.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

from hf_zeroone import OneBitAdam, ZeroOneAdam

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))  # recipes/ is not a package
from bench_step import build_model  # noqa: E402 - a small BERT: embeddings with masked rows, many shapes

#: name -> (optimizer class, keywords): every phase within ``--steps`` steps
RUNS = {
    "1-bit Adam": (OneBitAdam, {"freeze_step": 5}),
    "0/1 Adam": (
        ZeroOneAdam,
        {"var_freeze_step": 8, "var_update_scaler": 2, "local_step_scaler": 3, "local_step_clipper": 4},
    ),
    "0/1 Adam, clip_to_variance=False": (
        ZeroOneAdam,
        {
            "var_freeze_step": 8,
            "var_update_scaler": 2,
            "local_step_scaler": 3,
            "local_step_clipper": 4,
            "clip_to_variance": False,
        },
    ),
}


def fingerprint(cls: type, kwargs: dict, steps: int = 40, seed: int = 0) -> str:
    """The hash of the parameters and the optimizer's state after ``steps`` steps of shrinking random gradients."""
    params = list(build_model(4, 16).parameters())  # seeded inside
    opt = cls(params, lr=1e-2, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * (0.97**step)
            if p.dim() == 2 and p.shape[0] >= 512 and step < steps // 2:  # the word embedding: unseen tokens
                p.grad[p.shape[0] // 2 :] = 0.0
        opt.step()
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().numpy().tobytes())
    for state in opt.state.values():
        for key in sorted(state):
            if torch.is_tensor(state[key]):
                digest.update(key.encode())
                digest.update(state[key].detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per run (default 40: every phase)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| run | hash of parameters and state |\n|---|---|")
    for name, (cls, kwargs) in RUNS.items():
        print(f"| {name} | {fingerprint(cls, kwargs, args.steps)} |")


if __name__ == "__main__":
    main()
