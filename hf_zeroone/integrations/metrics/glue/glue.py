"""GLUE metrics as a local ``evaluate`` module (works offline).

Load it by path: ``evaluate.load(hf_zeroone.integrations.metrics.GLUE_METRIC_PATH, "mrpc")``.
Official definitions (Wang et al., 2019, https://gluebenchmark.com): Matthews correlation for
CoLA, F1 and accuracy for MRPC and QQP, Pearson and Spearman correlation for STS-B, accuracy for
the other tasks (SST-2, MNLI matched / mismatched, QNLI, RTE, WNLI, and AX by Matthews).
"""

import datasets
import evaluate
import numpy
import scipy.stats
import sklearn.metrics

_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli", "ax")

_DESCRIPTION = "GLUE benchmark metrics, computed with scikit-learn and scipy."

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted labels (ints), or scores (floats) for stsb.
    references: gold labels (ints), or scores (floats) for stsb.
Returns:
    cola, ax: {"matthews_correlation"}; mrpc, qqp: {"accuracy", "f1"};
    stsb: {"pearson", "spearmanr"}; the others: {"accuracy"}.
"""


class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name not in _TASKS:
            raise KeyError(f"unknown GLUE task {self.config_name!r}; expected one of {', '.join(_TASKS)}")
        value_type = "float32" if self.config_name == "stsb" else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Wang et al., GLUE: A Multi-Task Benchmark and Analysis Platform for NLU, ICLR 2019",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value(value_type), "references": datasets.Value(value_type)}
            ),
        )

    def _compute(self, predictions, references):
        preds = numpy.asarray(predictions)
        refs = numpy.asarray(references)
        task = self.config_name
        if task in ("cola", "ax"):
            return {"matthews_correlation": float(sklearn.metrics.matthews_corrcoef(refs, preds))}
        if task == "stsb":
            return {
                "pearson": float(scipy.stats.pearsonr(preds, refs)[0]),
                "spearmanr": float(scipy.stats.spearmanr(preds, refs)[0]),
            }
        accuracy = float((preds == refs).mean())
        if task in ("mrpc", "qqp"):
            return {"accuracy": accuracy, "f1": float(sklearn.metrics.f1_score(refs, preds))}
        return {"accuracy": accuracy}
