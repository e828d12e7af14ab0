# torchrun --standalone --nproc_per_node 2 examples/trainer.py
import torch
from transformers import BertConfig, BertForSequenceClassification

from hf_zeroone import ZeroOneTrainer, ZeroOneTrainingArguments

torch.manual_seed(0)
ids = torch.randint(5, 100, (512, 16))  # a toy task: does token 7 occur?
train_dataset = [{"input_ids": x, "labels": int((x == 7).any())} for x in ids]
config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
model = BertForSequenceClassification(config)

args = ZeroOneTrainingArguments(
    output_dir="outputs/trainer_example",
    optim_compression="zeroone_adam",  # or "onebit_adam"; "adamw_torch" compresses nothing
    warmup_ratio=0.1,  # on transformers 4.x and 5.x; the compression schedule follows the LR warm-up
    max_steps=40,
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    logging_steps=10,
    use_cpu=True,  # CPU processes under torchrun: DDP over gloo (leave it out on GPUs)
    save_strategy="no",
    report_to=[],
)
trainer = ZeroOneTrainer(model=model, args=args, train_dataset=train_dataset)
trainer.train()
if trainer.is_world_process_zero():
    print({k: v for k, v in trainer.state.log_history[-1].items() if k.startswith(("comm/", "train_loss"))})
