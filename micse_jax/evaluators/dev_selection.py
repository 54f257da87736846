"""Model selection on STS-B dev during training, and the final evaluation of the best params.

SimCSE/miCSE protocol: every `eval_every` steps the online encoder's [CLS] before the MLP head
is scored on STS-B dev (Spearman x100, `workdir.BEST_METRIC`); the trainer keeps the best
params in `workdir/best/`, and at the end they are evaluated on `eval.final_tasks` into
`workdir/results.json`.
"""
from __future__ import annotations

import logging
import os

import jax
import ml_collections

from micse_jax import workdir as workdir_lib
from micse_jax.encoder import SentenceEncoder
from micse_jax.evaluation import report, sts
from micse_jax.evaluation.runner import run_evaluation

EVAL_POOLER = "cls_before_pooler"


def params_encode_fn(encoder: SentenceEncoder, params: dict, batch_size: int):
  """An encode function (list[str] → float32 [n, dim]) for explicit training params."""
  return lambda sentences: encoder.encode(sentences, EVAL_POOLER, batch_size=batch_size,
                                          params=params["encoder"], head_params=params["head"])


class DevSelection:
  """Scores STS-B dev (and optionally SICK-R dev) of explicit params with [CLS] before the MLP.

  The SentEval directory and its tasks were checked once before the run (`config_checks.check_senteval`);
  a missing default directory only turns selection off, with a warning.
  """

  def __init__(self, encoder: SentenceEncoder, eval_config: ml_collections.ConfigDict, eval_every: int):
    self.dir = eval_config.senteval_dir
    self.enabled = eval_every > 0 and os.path.isdir(self.dir)
    if eval_every > 0 and not self.enabled:
      logging.warning("SentEval data not found at %s: no dev-set model selection", self.dir)
    self.encoder, self.config = encoder, eval_config

  @property
  def has_final_tasks(self) -> bool:
    """Whether `final_evaluation` has anything to do (tasks named, SentEval data present)."""
    return bool(self.config.final_tasks) and os.path.isdir(self.dir)

  def encode_fn(self, params):
    """list[str] → embeddings of `params` (`{'encoder', 'head', ...}`) with the evaluation pooler."""
    return params_encode_fn(self.encoder, params, self.config.batch_size)

  def __call__(self, params) -> dict[str, float]:
    """`{BEST_METRIC: STS-B dev Spearman x100}` (+ `sickr_dev` when `eval.sickr_dev`)."""
    encode = self.encode_fn(params)
    scores = {workdir_lib.BEST_METRIC: sts.stsb_dev_spearman(encode, self.dir)}
    if self.config.sickr_dev:
      scores["sickr_dev"] = sts.sickr_dev_spearman(encode, self.dir)
    return scores


def final_evaluation(selection: DevSelection, workdir: str, params, which: str) -> dict:
  """Evaluates `params` (described by `which`) on `eval.final_tasks`; writes results.json."""
  if not selection.has_final_tasks:
    return {}
  results = run_evaluation(selection.encode_fn(params), selection.dir, selection.config.final_tasks)
  document = report.build_report(results, model=os.path.abspath(workdir), pooler=EVAL_POOLER,
                                 settings={**results["settings"], "checkpoint": which},
                                 elapsed_seconds=results["elapsed_seconds"])
  if jax.process_index() == 0:
    report.write_json(os.path.join(workdir, workdir_lib.RESULTS_FILE), document)
    print(report.markdown_table(document))
  return document
