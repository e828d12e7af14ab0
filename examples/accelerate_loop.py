# ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py
import torch
from accelerate import Accelerator

from hf_zeroone import OneBitAdam
from hf_zeroone.integrations import prepare_zeroone

accelerator = Accelerator()
torch.manual_seed(0)
x = torch.randn(1024, 32)
data = torch.utils.data.TensorDataset(x, x[:, :8].sum(1, keepdim=True).sin())
loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
optimizer = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=10)  # 10 exact steps, then 1-bit momentum

model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
prepare_zeroone(accelerator, model, optimizer)  # registers the hook on the DDP model
onebit = optimizer.optimizer  # the hf_zeroone optimizer inside Accelerate's wrapper
for epoch in range(2):
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.print(f"epoch {epoch}: {onebit.last_step_kind.value}, {onebit.comm_stats.bytes_sent} bytes sent")
