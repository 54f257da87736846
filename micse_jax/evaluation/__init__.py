"""Evaluation in one package: SentEval's data readers, the STS (Spearman) and transfer (logistic
regression) protocols; the evaluators that run during training (`evaluators/`); the `micse-evaluate`
command (`command.py`, run as `python -m micse_jax.evaluate`).

The readers import eagerly (NumPy only); the protocol functions load on first use, so that
reading or validating data does not import JAX, scipy or scikit-learn.
"""
import importlib

from micse_jax.evaluation.senteval_data import (
  ALL_TASKS,
  STS7,
  TRANSFER7,
  SentEvalDataError,
  check_senteval_dir,
  download_senteval,
  resolve_tasks,
  validate_tasks,
)

_LAZY = {
    "evaluate_sts": "sts", "stsb_dev_spearman": "sts", "sickr_dev_spearman": "sts",
    "evaluate_transfer": "transfer", "build_report": "report", "write_json": "report",
    "markdown_table": "report",
}

__all__ = ["ALL_TASKS", "STS7", "TRANSFER7", "SentEvalDataError", "check_senteval_dir",
           "download_senteval", "resolve_tasks", "validate_tasks", *_LAZY]


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
