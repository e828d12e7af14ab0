"""recipes/count_ops.py on 2 CPU ranks: every step kind of both optimizers gets a row of counts."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "count_ops.py"


@pytest.mark.slow
def test_count_ops_prints_a_row_per_step_kind():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(RECIPE),
           "--tensors", "4,8", "--steps", "12"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    row = re.compile(r"^\| ([^|]+?) \| (\w[\w ]*?) \| (\d+) \| (-?\d+) \|", re.M)
    rows = {tuple(m[:2]): m[2:] for m in row.findall(proc.stdout)}
    kinds = {("1-bit Adam", k) for k in ("exact", "onebit_momentum")}
    kinds |= {("0/1 Adam", k) for k in ("exact", "onebit_gradient", "local", "onebit_sync")}
    assert kinds | {("DDP + AdamW(foreach=True)", "whole step")} == set(rows), proc.stdout
    assert rows[("DDP + AdamW(foreach=True)", "whole step")][1] == "0"
    # a compressed step dispatches more than AdamW's whole step: its messages, compression and update
    assert int(rows[("1-bit Adam", "onebit_momentum")][1]) > 0, proc.stdout
    # but no more per added tensor than DDP + AdamW: the optimizer's work does not grow with the tensors
    growth = re.compile(r"^\| ([^|]+?) \| (\w[\w ]*?) \|(?: [^|]+ \|){3} (-?[\d.]+) \|", re.M)
    per_tensor = {tuple(m[:2]): float(m[2]) for m in growth.findall(proc.stdout)}
    assert set(per_tensor) == set(rows), proc.stdout
    assert all(value <= 0.0 for value in per_tensor.values()), proc.stdout
    # and the growth of all operations, nested ones included, for every row
    nested = re.compile(r"^\| ([^|]+?) \| (\w[\w ]*?) \|(?: [^|]+ \|){4} (-?[\d.]+) \| [\d.]+x \|$", re.M)
    assert {tuple(m[:2]) for m in nested.findall(proc.stdout)} == set(rows), proc.stdout


@pytest.mark.parametrize("biases", [False, True])
def test_every_tensor_of_the_counted_model_gets_a_non_zero_gradient(biases):
    """A model whose gradients vanish would count the masks of untrained tensors, not a training step."""
    sys.path.insert(0, str(RECIPE.parent))
    try:
        from count_ops import _model
    finally:
        sys.path.remove(str(RECIPE.parent))
    model = _model(400, biases)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(0))).square().mean().backward()
    zero = [i for i, p in enumerate(model.parameters()) if not bool((p.grad != 0).all())]
    assert not zero, f"{len(zero)} of 400 tensors have a zero gradient element, the first at layer {zero[0]}"
