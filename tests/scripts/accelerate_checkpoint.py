"""Save with accelerator.save_state mid-run, then load_state into a fresh model and optimizer.

Each rank's optimizer state after load_state (error buffers included) must equal its own state at
save time. (Training on does not continue bit for bit: a fresh DDP model uses its initial buckets
for one iteration, which changes the compressed layout.)

Run under accelerate launch by tests/test_accelerate_plugin.py. Writes OUT_DIR/rank{r}.json.
"""

import json
import os
import sys

import torch
from accelerate import Accelerator

from hf_zeroone import OneBitAdam
from hf_zeroone.integrations import prepare_zeroone

SAVE_AT = 7


def _state(optimizer) -> dict[str, torch.Tensor]:
    inner = optimizer.optimizer
    return {
        f"{i}.{name}": value.detach().clone()
        for i, p in enumerate(inner.param_groups[0]["params"])
        for name, value in inner.state[p].items()
        if isinstance(value, torch.Tensor)
    }


def run(accelerator: Accelerator, folder: str, resume: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    g = torch.Generator().manual_seed(accelerator.process_index)
    data = [torch.randn(16, 8, generator=g) for _ in range(SAVE_AT)]
    model, optimizer = accelerator.prepare(model, optimizer)
    prepare_zeroone(accelerator, model, optimizer)
    if resume:
        accelerator.load_state(folder)
    else:
        for x in data:
            accelerator.backward(((model(x) - x.sum(1, keepdim=True)) ** 2).mean())
            optimizer.step()
            optimizer.zero_grad()
        accelerator.save_state(folder)
    state = _state(optimizer)
    accelerator.free_memory()
    return state


def main() -> None:
    out = sys.argv[1]
    accelerator = Accelerator()
    saved = run(accelerator, os.path.join(out, "ckpt"), resume=False)
    loaded = run(accelerator, os.path.join(out, "ckpt"), resume=True)
    result = {
        "rank": accelerator.process_index,
        "has_errors": any(k.endswith("worker_error") for k in saved),
        "differing": sorted(k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k])),
        "files": sorted(f for f in os.listdir(os.path.join(out, "ckpt")) if f.startswith("hf_zeroone")),
    }
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
