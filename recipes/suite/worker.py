"""One run of the suite: one workload, one method. Started under ``torchrun`` by ``launch.py``.

    torchrun --standalone --nproc_per_node N recipes/suite/worker.py RUN_DIR/spec.json

The spec is the JSON ``convergence.py`` or ``frontier.py`` wrote; rank 0 writes
``RUN_DIR/result.json``. Not meant to be run by hand, but it can be, with such a spec.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: pretrain.py and suite/

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    if spec["workload"] == "finetune":
        from suite.finetune import run_finetune

        result = run_finetune(spec)  # the Trainer sets up the process group itself
        rank = dist.get_rank() if dist.is_initialized() else 0
    else:
        from suite.workloads import run_loop

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        result = run_loop(spec, rank, world)
    if rank == 0:
        result.update(workload=spec["workload"], optimizer=spec["optimizer"], world_size=int(os.environ["WORLD_SIZE"]))
        Path(spec["run_dir"], "result.json").write_text(json.dumps(result))
    if dist.is_initialized():
        # The run's DDP model, hooks and optimizers sit in reference cycles: collected only at exit, after the
        # process group is gone, a reducer's threads can abort the process ("terminate called without an
        # active exception", seen once with post-local SGD). Collect them while the group still exists.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
