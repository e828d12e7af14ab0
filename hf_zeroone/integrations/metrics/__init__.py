"""Local ``evaluate`` metric modules (loaded by path, no hub needed)."""

from pathlib import Path

#: pass to ``evaluate.load(GLUE_METRIC_PATH, task_name)``
GLUE_METRIC_PATH = str(Path(__file__).parent / "glue" / "glue.py")

__all__ = ["GLUE_METRIC_PATH"]
