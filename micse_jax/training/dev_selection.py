"""Model selection on STS-B dev during training, and the final evaluation of the best params.

SimCSE/miCSE protocol: every `eval_every` steps the online encoder's [CLS] before the MLP head
is scored on STS-B dev (Spearman x100); the best params are kept in `workdir/best/`, and at
the end they are evaluated on `eval.final_tasks` into `workdir/results.json`.
"""
from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

import jax

from micse_jax import workdir as workdir_lib
from micse_jax.encoder import SentenceEncoder
from micse_jax.evaluation import report, senteval_data, sts
from micse_jax.evaluation.runner import run_evaluation
from micse_jax.models.bert import BertModel
from micse_jax.training import checkpoint

if TYPE_CHECKING:
  from micse_jax.training.trainer import Run

EVAL_POOLER = "cls_before_pooler"


def params_encode_fn(encoder: SentenceEncoder, params: dict, batch_size: int):
  """An encode function (list[str] → float32 [n, dim]) for explicit training params."""
  return lambda sentences: encoder.encode(sentences, EVAL_POOLER, batch_size=batch_size,
                                          params=params["encoder"], head_params=params["head"])


class DevSelector:
  """Scores STS-B dev (and optionally SICK-R dev) with [CLS] before the MLP; keeps the best."""

  def __init__(self, run: Run, workdir: str):
    self.dir = run.config.eval.senteval_dir
    self.enabled = run.config.eval_every > 0 and os.path.isdir(self.dir)
    if run.config.eval_every > 0 and not self.enabled:
      logging.warning("SentEval data not found at %s: no dev-set model selection", self.dir)
    if self.enabled:
      senteval_data.check_senteval_dir(self.dir)
    self.run = run
    self.encoder = SentenceEncoder(BertModel(run.bert_config, dtype=run.nets.online.dtype), None,
                                   run.tokenizer, model_dir=run.model_dir)
    self.manager = workdir_lib.best_manager(workdir)
    self.best = self._stored_best()

  def _stored_best(self) -> float:
    step = self.manager.best_step()
    return float(self.manager.metrics(step)[workdir_lib.BEST_METRIC]) if step is not None else -math.inf

  def encode_fn(self, params):
    return params_encode_fn(self.encoder, params, self.run.config.eval.batch_size)

  def __call__(self, state) -> dict:
    encode = self.encode_fn(state.params)
    scores = {workdir_lib.BEST_METRIC: sts.stsb_dev_spearman(encode, self.dir)}
    if self.run.config.eval.sickr_dev:
      scores["sickr_dev"] = sts.sickr_dev_spearman(encode, self.dir)
    if scores[workdir_lib.BEST_METRIC] > self.best:
      self.best = scores[workdir_lib.BEST_METRIC]
      checkpoint.save_best(self.manager, int(state.step), state.params, self.best)
    return scores


def final_evaluation(run: Run, workdir: str, state, selector: DevSelector) -> dict:
  """Evaluates the best (else the last) params on `eval.final_tasks`; writes results.json."""
  tasks = run.config.eval.final_tasks
  if not tasks or not os.path.isdir(run.config.eval.senteval_dir):
    return {}
  params, which = state.params, f"last step {int(state.step)}"
  if selector.manager.all_steps():
    best_step, params = workdir_lib.restore_params(workdir, "best")  # on any topology
    which = f"best STS-B dev (step {best_step}, {selector.best:.2f})"
  results = run_evaluation(selector.encode_fn(params), run.config.eval.senteval_dir, tasks)
  document = report.build_report(results, model=os.path.abspath(workdir), pooler=EVAL_POOLER,
                                 settings={**results["settings"], "checkpoint": which},
                                 elapsed_seconds=results["elapsed_seconds"])
  if jax.process_index() == 0:
    report.write_json(os.path.join(workdir, workdir_lib.RESULTS_FILE), document)
    print(report.markdown_table(document))
  return document
