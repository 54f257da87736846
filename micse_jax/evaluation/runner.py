"""`run_evaluation`: one encode function scored on SentEval STS and transfer tasks.

Used by the `micse_jax.evaluate` CLI, by the trainer's final evaluation and by Python callers.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from micse_jax.evaluation import senteval_data
from micse_jax.evaluation.senteval_data import SEED, STS7, TRANSFER7


def run_evaluation(encode_fn: Callable[[list[str]], np.ndarray], senteval_dir: str,
                   tasks: str | Sequence[str] = "sts", fast: bool = False,
                   seed: int = SEED, transfer_protocol: str = "senteval") -> dict:
  """Evaluates `encode_fn` on `tasks`; returns `{'sts': ..., 'transfer': ..., 'settings', ...}`.

  `sts` / `transfer` (present when such tasks ran) are `{'tasks': {name: result}, 'avg': x}`
  with Spearman x100 (`spearman`) and accuracy x100 (`acc`) as the headline numbers.
  `transfer_protocol`: `senteval` (SentEval's classifier, the papers' protocol) or `logreg`
  (exact logistic regression); see `micse_jax.evaluation.transfer`.
  """
  from micse_jax.evaluation import sts, transfer  # JAX, scipy, scikit-learn: loaded when an evaluation runs
  names = senteval_data.resolve_tasks(tasks)
  transfer.check_protocol(transfer_protocol)
  senteval_data.check_senteval_dir(senteval_dir)
  start = time.perf_counter()
  results = {"settings": {"tasks": names, "fast": fast, "seed": seed,
                          "senteval_dir": os.path.abspath(senteval_dir),
                          "sts": "cosine similarity, Spearman x100; STS12-16 'all' setting; "
                                 "STS-B / SICK-R test, unsupervised",
                          "transfer": transfer.protocol_settings(transfer_protocol, fast)}}
  sts_tasks = [t for t in names if t in STS7]
  transfer_tasks = [t for t in names if t in TRANSFER7]
  if sts_tasks:
    results["sts"] = sts.evaluate_sts(encode_fn, senteval_dir, sts_tasks)
  if transfer_tasks:
    results["transfer"] = transfer.evaluate_transfer(encode_fn, senteval_dir, transfer_tasks,
                                                     fast=fast, seed=seed,
                                                     protocol=transfer_protocol)
  results["elapsed_seconds"] = time.perf_counter() - start
  return results
