"""A small Accelerate training script using the hf_zeroone plugin (run by tests under accelerate launch).

Writes OUT_DIR/rank{r}.json per rank (OUT_DIR is the first argument): the rank, whether the hook
is on, a checksum of the parameters and the bytes sent. (Files, not stdout: two ranks printing at
once can interleave their lines.) A second argument ``diloco`` trains with OneBitDiLoCo (a sync
every 4 steps, and ``synchronize()`` after the loop) instead of 0/1 Adam.
"""

import json
import os
import sys

import torch
from accelerate import Accelerator

from hf_zeroone import OneBitDiLoCo, ZeroOneAdam
from hf_zeroone.integrations import prepare_zeroone


def main() -> None:
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    diloco = sys.argv[2:] == ["diloco"]
    if diloco:
        optimizer = OneBitDiLoCo(model.parameters(), lr=1e-2, sync_every=4)
    else:
        schedule = {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_clipper": 2}
        optimizer = ZeroOneAdam(model.parameters(), lr=1e-2, **schedule)
    g = torch.Generator().manual_seed(accelerator.process_index)
    data = [(torch.randn(16, 8, generator=g),) for _ in range(13)]  # ends on a sync (replicas agree)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = prepare_zeroone(accelerator, model, optimizer)
    for (x,) in data:
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    inner = optimizer.optimizer
    if diloco:
        inner.synchronize()  # 13 steps: the last sync was at 12
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    result = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "hook": state is not None,
        "comm_hook": bool(getattr(model, "_comm_hooks", None)),  # a hook replaced DDP's allreduce
        "syncs": inner.syncs if diloco else None,
        "checksum": checksum,
        "bytes": inner.comm_stats.bytes_sent,
        "steps": inner.local_steps if diloco else inner.schedule["step"],
        "last_kind": "diloco_sync" if diloco else inner.last_step_kind.value,
        "loss": float(loss),
    }
    with open(os.path.join(sys.argv[1], f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
