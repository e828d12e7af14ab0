"""The planner: its network model by hand, its schedules against the optimizers', its measurements, its CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_zeroone import OneBitAdam, ZeroOneAdam
from hf_zeroone.optim import StepKind
from hf_zeroone.plan import (
    Cluster,
    KindCost,
    Measurements,
    break_even_rate,
    build_model,
    parse_latency,
    parse_rate,
    project,
    random_batch,
    step_kind_counts,
)

REPO = Path(__file__).resolve().parents[1]
GBIT = 1e9


def test_rates_and_latencies_are_read_with_their_units() -> None:
    assert parse_rate("40gbit") == 40e9
    assert parse_rate("300mbit") == 300e6
    assert parse_rate("1.5tbit") == 1.5e12
    assert parse_latency("5us") == pytest.approx(5e-6)
    assert parse_latency("0.2ms") == pytest.approx(2e-4)
    assert parse_latency("0") == 0.0
    for bad in ("40gb", "fast", "0gbit", "-1mbit"):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="latency"):
        parse_latency("5")  # a number without a unit


def test_collective_times_by_hand() -> None:
    one_node = Cluster(1, 4, inter_rate=10 * GBIT, intra_rate=100 * GBIT, inter_latency=0, intra_latency=1e-6)
    # ring allreduce of 1 GB on 4 ranks: each sends 2 * 3/4 GB at 100 Gbit/s, 6 latency steps
    assert one_node.ring_allreduce_seconds(1e9) == pytest.approx(1.5e9 * 8 / 100e9 + 6e-6)
    nodes = Cluster(4, 2, inter_rate=10 * GBIT, intra_rate=100 * GBIT, inter_latency=0, intra_latency=0)
    # pairwise: a node's link carries its 2 ranks' shares for the 6 ranks on other nodes
    assert nodes.seconds(7e6, "pairwise", 0) == pytest.approx(2 * 7e6 * 6 / 7 * 8 / 10e9)
    # ring: one rank's stream crosses each node's link
    assert nodes.seconds(7e6, "ring", 0) == pytest.approx(7e6 * 8 / 10e9)
    shared = Cluster(1, 2, inter_rate=100e6, intra_rate=100e6, inter_latency=0, intra_latency=0, shared=True)
    # one medium: both ranks' bytes cross it
    assert shared.ring_allreduce_seconds(1e6) == pytest.approx(2 * 1e6 * 8 / 100e6)
    assert Cluster(1, 1, GBIT, GBIT).ring_allreduce_seconds(1e9) == 0.0
    with pytest.raises(ValueError, match="at least one node"):
        Cluster(0, 4, GBIT, GBIT)


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_step_kind_counts_follow_the_optimizers_own_schedule(cls: type) -> None:
    steps, warmup = 300, 10
    name = "1-bit Adam" if cls is OneBitAdam else "0/1 Adam"
    p = torch.nn.Parameter(torch.zeros(4))
    opt = cls([p], lr=1e-3)
    opt.set_run_length(steps, warmup)
    taken: dict[StepKind, int] = {}
    for _ in range(steps):
        p.grad = torch.ones(4)
        opt.step()
        taken[opt.last_step_kind] = taken.get(opt.last_step_kind, 0) + 1
    assert step_kind_counts(name, steps, warmup) == taken


def _synthetic() -> Measurements:
    kinds = {
        StepKind.EXACT: KindCost(0.020, 2_000_000, 4, True),
        StepKind.ONEBIT_MOMENTUM: KindCost(0.030, 250_000, 4, True),
    }
    return Measurements(device="cpu", world_size=8, parameters=1_000_000, tensors=10, buckets=1, forward=0.1,
                        backward=0.2, adamw_step=0.01, powersgd_seconds=0.05, powersgd_bytes=100_000,
                        kinds={"1-bit Adam": kinds})  # fmt: skip


def test_projection_by_hand_and_break_even() -> None:
    m = _synthetic()
    cluster = Cluster(4, 2, inter_rate=GBIT, intra_rate=100 * GBIT, inter_latency=0, intra_latency=0, overlap=False)
    rows = {r.method: r for r in project(m, cluster, steps=1000, warmup_steps=0)}
    ddp = rows["DDP fp32 gradients + AdamW"]
    assert ddp.seconds == pytest.approx(0.31 + 2 * 7 / 8 * 4e6 * 8 / GBIT)
    assert ddp.bytes_per_step == pytest.approx(2 * 7 / 8 * 4e6)
    assert ddp.speedup == 1.0
    exact = step_kind_counts("1-bit Adam", 1000, 0)[StepKind.EXACT]
    onebit = rows["1-bit Adam + hook"]
    assert onebit.bytes_per_step == pytest.approx((exact * 2e6 + (1000 - exact) * 2.5e5) / 1000)
    even = break_even_rate(m, cluster, "1-bit Adam + hook", 1000)
    assert 0 < even < math.inf
    below = {r.method: r.seconds for r in project(m, cluster.with_inter_rate(even / 2), 1000)}
    above = {r.method: r.seconds for r in project(m, cluster.with_inter_rate(even * 2), 1000)}
    assert below["1-bit Adam + hook"] < below["DDP fp32 gradients + AdamW"]
    assert above["1-bit Adam + hook"] > above["DDP fp32 gradients + AdamW"]
    with pytest.raises(ValueError, match="measured for 8 ranks"):
        project(m, Cluster(1, 2, GBIT, GBIT), 1000)


_MEASURE_SCRIPT = """
import warnings
from hf_zeroone.optim import StepKind
from hf_zeroone.plan import build_model, measure, random_batch

model = build_model("bert-tiny", hidden_size=32, intermediate_size=64, vocab_size=512)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    m = measure(model, random_batch(model, 2, 16), world_size=4, repeats=1)
assert m.parameters == sum(p.numel() for p in model.parameters())
assert min(m.forward, m.backward, m.adamw_step) > 0
assert set(m.kinds["1-bit Adam"]) == {StepKind.EXACT, StepKind.ONEBIT_MOMENTUM}
assert set(m.kinds["0/1 Adam"]) == {StepKind.EXACT, StepKind.ONEBIT_GRADIENT, StepKind.ONEBIT_SYNC, StepKind.LOCAL}
local = m.kinds["0/1 Adam"][StepKind.LOCAL]
assert local.bytes_sent == 0 and local.collectives == 0
exact, onebit = m.kinds["1-bit Adam"][StepKind.EXACT], m.kinds["1-bit Adam"][StepKind.ONEBIT_MOMENTUM]
# float8 exact steps: one byte an element each way, plus block scales and padding; 1-bit: an eighth of that
assert 2 * 3 / 4 * m.parameters <= exact.bytes_sent <= 1.1 * 2 * 3 / 4 * m.parameters, exact
assert exact.bytes_sent / 9 < onebit.bytes_sent < exact.bytes_sent / 6, (exact, onebit)
assert all(p.grad is None for p in model.parameters())
print("measured")
"""


def _python(script: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter: it makes a gloo process group, which stays out of pytest's."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_measure_counts_each_kind_and_its_bytes() -> None:
    res = _python(_MEASURE_SCRIPT)
    assert res.returncode == 0 and "measured" in res.stdout, res.stderr[-3000:]


def test_build_model_reads_a_config_file_offline(tmp_path: Path) -> None:
    config = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 100, "n_positions": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = build_model(str(tmp_path))
    assert model.config.n_embd == 32 and model(**random_batch(model, 1, 8)).loss.ndim == 0
    with pytest.raises(ValueError, match="unknown model"):
        build_model("no-such-model")
    with pytest.raises(ValueError, match="longer than"):
        random_batch(model, 1, 65)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_zeroone.plan", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)  # fmt: skip


def test_cli_prints_every_method_and_a_break_even_rate(tmp_path: Path) -> None:
    res = _cli("--model", "bert-tiny", "--batch-size", "2", "--seq-len", "16", "--nodes", "2", "--gpus-per-node",
               "2", "--inter-rate", "1gbit", "--intra-rate", "100gbit", "--steps", "1000", "--repeats", "1",
               "--plot", str(tmp_path / "speedup.png"))  # fmt: skip
    assert res.returncode == 0, res.stderr
    for method in ("DDP fp32", "DDP bf16", "PowerSGD", "1-bit Adam + hook", "0/1 Adam + hook", "DiLoCo H=16"):
        assert f"| {method}" in res.stdout or method in res.stdout, method
    assert "1-bit Adam is faster than DDP fp32 below" in res.stdout
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_bad_input_before_measuring() -> None:
    res = _cli("--inter-rate", "40gb")
    assert res.returncode != 0 and "cannot read the rate '40gb'" in res.stderr
    res = _cli("--model", "no-such-model", "--nodes", "1")
    assert res.returncode != 0 and "unknown model" in res.stderr


def test_powersgd_is_measured_on_parameters_of_several_ddp_buckets() -> None:
    """torch's hook issues collectives in future callbacks: with DDP's default 25 MiB buckets, 96 MB hang on gloo."""
    res = _python(
        "import math, torch\n"
        "from hf_zeroone.plan._measure import _powersgd_seconds\n"
        "params = [torch.nn.Parameter(torch.randn(2048, 2048)) for _ in range(6)]\n"
        "print('seconds', _powersgd_seconds(params, 1, torch.device('cpu')))\n"
    )
    assert res.returncode == 0 and "seconds" in res.stdout, res.stderr[-3000:]
