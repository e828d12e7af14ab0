# torchrun --standalone --nproc_per_node 2 examples/ddp_loop.py
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_zeroone import ZeroOneAdam
from hf_zeroone.ddp_hook import register_zeroone_hook

dist.init_process_group("gloo")  # "nccl" on GPUs (then move the model to the rank's device)
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
ddp_model = DDP(model)
optimizer = ZeroOneAdam(  # a short schedule, to see every phase in 40 steps (real runs: see below)
    ddp_model.parameters(),
    lr=1e-3,
    weight_decay=0.01,
    exact_warmup_steps=10,  # exact averages first (as float8 messages, the default exact_step_dtype)
    var_freeze_step=20,  # 1-bit gradients with a few exact variance steps until here, then local steps
    var_update_scaler=2,
    local_step_scaler=5,
)
register_zeroone_hook(ddp_model, optimizer)  # replaces DDP's fp32 gradient allreduce

data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
previous_kind = None
for step in range(1, 41):
    x = torch.randn(16, 32, generator=data)
    loss = torch.nn.functional.mse_loss(ddp_model(x), x[:, :8].sum(1, keepdim=True).sin())
    loss.backward()  # 1-bit communication overlaps with backward
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    kind, sent = optimizer.last_step_kind.value, optimizer.last_step_stats.bytes_sent
    if dist.get_rank() == 0 and (step % 10 == 0 or kind != previous_kind):
        print(f"step {step}: {kind}, {sent} bytes sent, loss {loss.item():.3f}")
    previous_kind = kind
dist.destroy_process_group()
