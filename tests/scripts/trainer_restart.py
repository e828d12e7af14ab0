"""ZeroOneTrainer run that can kill one of its ranks mid-run (for the torchrun restart test).

    torchrun --nproc_per_node 2 --max-restarts 1 tests/scripts/trainer_restart.py OUT_DIR KILL_AT_STEP

On the first attempt rank 1 kills itself (SIGKILL) after step KILL_AT_STEP (0 = never); torchrun
restarts both ranks, which resume from the last checkpoint. Each rank writes OUT_DIR/result_rank{r}.json.
"""

import json
import os
import signal
import sys

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hf_zeroone import ZeroOneTrainer, ZeroOneTrainingArguments  # noqa: E402

from _hf import TokenParityDataset, tiny_bert  # noqa: E402


class KillAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.step and attempt == 0 and state.global_step == self.step and int(os.environ["RANK"]) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return control


def init_distributed() -> None:
    """Join the process group under a store prefix unique to this restart attempt.

    After a torchrun restart, the default process group's keys in the agent's store can still
    hold the previous attempt's addresses, and a rank that reads one before its peer overwrote it
    fails with "Connection refused" (seen here about one time in two). A per-attempt prefix rules
    that out.
    """
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), is_master=False
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"restart_test/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def main() -> None:
    out_dir, kill_at = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    init_distributed()
    args = ZeroOneTrainingArguments(
        output_dir=out_dir, use_cpu=True, max_steps=16, per_device_train_batch_size=8, learning_rate=1e-3,
        warmup_steps=2, logging_steps=1, report_to=[], save_strategy="steps", save_steps=4, disable_tqdm=True,
        seed=0, optim_compression="zeroone_adam", var_update_scaler=1, local_step_scaler=2, local_step_clipper=4,
        check_replicas_every=1,
    )  # fmt: skip
    model = tiny_bert()
    trainer = ZeroOneTrainer(model=model, args=args, train_dataset=TokenParityDataset(), callbacks=[KillAt(kill_at)])
    last = get_last_checkpoint(out_dir) if os.path.isdir(out_dir) else None
    trainer.train(resume_from_checkpoint=last)
    opt = trainer.optimizer.optimizer
    checksum = [float(p.detach().double().sum()) for p in model.parameters()]
    rank = int(os.environ["RANK"])
    result = {
        "rank": rank,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "resumed_from": last,
        "global_step": trainer.state.global_step,
        "schedule": opt.schedule,
        "checksum": checksum,
    }
    with open(os.path.join(out_dir, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
