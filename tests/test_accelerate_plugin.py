"""The Accelerate plugin under a real `accelerate launch` with two CPU processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).parent / "scripts" / "accelerate_train.py"


def _launch_two_cpu_ranks(script: Path, out_dir: Path, *extra: str) -> list[dict]:
    """Run ``script out_dir`` under ``accelerate launch`` on 2 CPU processes; return each rank's JSON."""
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(out_dir), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes_with_the_hook(tmp_path):
    rows = _launch_two_cpu_ranks(SCRIPT, tmp_path)
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["world"] == 2 and r["hook"] and r["steps"] == 13 and r["bytes"] > 0 for r in rows)
    assert rows[0]["last_kind"] == "onebit_sync"  # replicas agree after every sync
    assert rows[0]["checksum"] == rows[1]["checksum"]


@pytest.mark.slow
def test_accelerate_launch_with_onebit_diloco(tmp_path):
    rows = _launch_two_cpu_ranks(SCRIPT, tmp_path, "diloco")
    # its hook has no state, but it is on DDP: backward sends nothing
    assert all(r["world"] == 2 and not r["hook"] and r["comm_hook"] and r["steps"] == 13 for r in rows)
    assert all(r["syncs"] == 4 for r in rows)  # 3 on schedule, the last by synchronize()
    assert rows[0]["bytes"] > 0 and rows[0]["bytes"] % 4 == 0  # the same bytes each
    assert rows[0]["checksum"] == rows[1]["checksum"]


@pytest.mark.slow
def test_save_state_and_load_state_keep_every_ranks_error_buffers(tmp_path):
    rows = _launch_two_cpu_ranks(Path(__file__).parent / "scripts" / "accelerate_checkpoint.py", tmp_path)
    assert rows[0]["files"] == ["hf_zeroone_optimizer_rank0.pt", "hf_zeroone_optimizer_rank1.pt"]
    for r in rows:  # rank 1 too: its own error buffers, not rank 0's (nor zeros)
        assert r["has_errors"] and r["differing"] == [], r


class _FakeType:
    def __init__(self, name):
        self.name = name


class _FakeAccelerator:
    def __init__(self, name, num_processes=2):
        self.distributed_type = _FakeType(name)
        self.num_processes = num_processes
        self.mixed_precision = "no"


@pytest.mark.parametrize("name, match", [("FSDP", "FSDP"), ("DEEPSPEED", "DeepSpeed"), ("MEGATRON_LM", "Megatron")])
def test_unsupported_setups_are_refused(name, match):
    import torch

    from hf_zeroone import OneBitAdam
    from hf_zeroone.integrations import prepare_zeroone

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        prepare_zeroone(_FakeAccelerator(name), model, OneBitAdam(model.parameters()))


def test_plugin_needs_our_optimizer_and_is_a_no_op_in_one_process():
    import torch

    from hf_zeroone import OneBitAdam
    from hf_zeroone.integrations import prepare_zeroone

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs a hf_zeroone optimizer"):
        prepare_zeroone(_FakeAccelerator("MULTI_CPU"), model, torch.optim.AdamW(model.parameters()))
    assert prepare_zeroone(_FakeAccelerator("NO", 1), model, OneBitAdam(model.parameters())) is None
