# ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py
import torch
from accelerate import Accelerator

from hf_zeroone import ZeroOneAdam
from hf_zeroone.integrations import prepare_zeroone

accelerator = Accelerator()
torch.manual_seed(0)
x = torch.randn(1024, 32)
data = torch.utils.data.TensorDataset(x, x[:, :8].sum(1, keepdim=True).sin())
loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
optimizer = ZeroOneAdam(model.parameters(), lr=1e-3)  # its schedule follows the run length given below

epochs = 3
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
# the hook on the DDP model, and the run length in optimizer steps (here no LR warm-up: num_warmup_steps=0)
prepare_zeroone(accelerator, model, optimizer, num_training_steps=epochs * len(loader), num_warmup_steps=0)
zeroone = optimizer.optimizer  # the hf_zeroone optimizer inside Accelerate's wrapper
for epoch in range(epochs):
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.print(f"epoch {epoch}: {zeroone.last_step_kind.value}, {zeroone.comm_stats.bytes_sent} bytes sent")
zeroone.synchronize()  # replicas differ between 0/1 Adam's syncs: one model before evaluating or saving
accelerator.print(f"replicas in sync: {zeroone.in_sync}")
