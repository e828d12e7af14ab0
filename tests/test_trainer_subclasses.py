"""ZeroOneTrainer's behaviour in any Trainer subclass (``with_zeroone``): TRL's SFTTrainer, Seq2SeqTrainer, on 2 ranks.

And the end of training: a run that ends between two syncs of 0/1 Adam's local phase leaves
bit-identical replicas once ``train()`` returns.
"""

import pytest
import torch

from _dist import run_ranks

pytest.importorskip("transformers")

COMMON = dict(
    use_cpu=True, per_device_train_batch_size=4, learning_rate=1e-3, report_to=[], save_strategy="no",
    disable_tqdm=True, logging_steps=2, seed=0, optim_compression="zeroone_adam",
    var_update_scaler=2, local_step_scaler=2, local_step_clipper=8,
)  # fmt: skip


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(30)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]")


def _outcome(trainer) -> dict:
    from hf_zeroone.integrations import unwrap_optimizer

    opt = unwrap_optimizer(trainer.optimizer)
    return {
        "cls": type(trainer).__name__,
        "optimizer": type(opt).__name__,
        "hook": trainer._hook_state is not None,
        "last_kind": opt.last_step_kind.value,
        "sent": opt.comm_stats.bytes_sent,
        "logged": any("comm/bytes_sent" in e for e in trainer.state.log_history),
        "flat": torch.cat([p.detach().flatten() for p in trainer.model.parameters()]),
    }


def _sft(rank, world, out_dir):
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel
    from trl import SFTConfig, SFTTrainer

    from hf_zeroone import with_zeroone

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 30, (96,), generator=g).tolist()
    texts = [" ".join(f"w{(i + 3 * j) % 30}" for j in range(12)) for i in starts]
    trainer_cls, config_cls = with_zeroone(SFTTrainer), with_zeroone(SFTConfig)
    args = config_cls(output_dir=out_dir, max_steps=21, max_length=16, **COMMON)
    trainer = trainer_cls(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}),
        processing_class=_word_tokenizer(),
    )  # fmt: skip
    trainer.train()
    return _outcome(trainer)


def _seq2seq(rank, world, out_dir):
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

    from hf_zeroone import with_zeroone

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=32, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(2, 32, (96, 10), generator=g)
    data = [{"input_ids": s, "labels": s.flip(0)} for s in src]  # learn to reverse
    trainer_cls, args_cls = with_zeroone(Seq2SeqTrainer), with_zeroone(Seq2SeqTrainingArguments)
    args = args_cls(output_dir=out_dir, max_steps=21, **COMMON)
    trainer = trainer_cls(model=model, args=args, train_dataset=data)
    trainer.train()
    return _outcome(trainer)


def _check(res):
    r0, r1 = res
    assert r0["cls"].startswith("ZeroOne") and r0["optimizer"] == "ZeroOneAdam"
    assert r0["hook"] and r0["logged"] and r0["sent"] > 0
    assert r0["last_kind"] == "local"  # the run ended between two syncs...
    assert torch.equal(r0["flat"], r1["flat"])  # ...and train() returned one model on both ranks


@pytest.mark.slow
def test_sft_trainer_with_zeroone_on_two_ranks(tmp_path):
    pytest.importorskip("trl")
    _check(run_ranks(_sft, 2, str(tmp_path), timeout=300))


@pytest.mark.slow
def test_seq2seq_trainer_with_zeroone_on_two_ranks(tmp_path):
    _check(run_ranks(_seq2seq, 2, str(tmp_path), timeout=300))


def test_with_zeroone_builds_each_class_once_and_refuses_others():
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from hf_zeroone import ZeroOneTrainer, ZeroOneTrainingArguments, with_zeroone
    from hf_zeroone.integrations import ZeroOneArgumentsMixin, ZeroOneTrainerMixin

    cls = with_zeroone(Seq2SeqTrainer)
    assert (
        issubclass(cls, ZeroOneTrainerMixin) and issubclass(cls, Seq2SeqTrainer) and with_zeroone(Seq2SeqTrainer) is cls
    )
    args_cls = with_zeroone(Seq2SeqTrainingArguments)
    assert issubclass(args_cls, ZeroOneArgumentsMixin) and issubclass(args_cls, Seq2SeqTrainingArguments)
    assert with_zeroone(ZeroOneTrainer) is ZeroOneTrainer
    assert with_zeroone(ZeroOneTrainingArguments) is ZeroOneTrainingArguments
    with pytest.raises(TypeError, match="Trainer or TrainingArguments"):
        with_zeroone(torch.nn.Linear)
