"""Model selection on STS-B dev during training, and the final evaluation of the best params.

SimCSE/miCSE protocol: every `eval_every` steps the online encoder's [CLS] before the MLP head
is scored on STS-B dev (Spearman x100); the best params are kept in `workdir/best/`, and at
the end they are evaluated on `eval.final_tasks` into `workdir/results.json`.

The dev splits are read and tokenized once per run (`PlannedPairs`); each evaluation only runs
the encoder's jitted programs (compiled at the first evaluation) and scores. A new best is saved
asynchronously; the trainer waits for it before the final evaluation reads it back.
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


class PlannedPairs:
  """One dev split's pairs with their distinct sentences tokenized and batched once per run."""

  def __init__(self, encoder: SentenceEncoder, pairs, batch_size: int):
    self.pairs = pairs
    self.sentences = list(dict.fromkeys(pairs.sentences1 + pairs.sentences2))  # as sts.encode_unique
    self.plan = encoder.plan(self.sentences, batch_size)
    self.encoder = encoder

  def spearman(self, params: dict) -> float:
    """`sts.split_spearman` of the split with `params`, embedding the stored plan."""
    def encode(sentences):
      if sentences != self.sentences:
        raise ValueError("a planned dev split was asked to encode other sentences")
      return self.encoder.encode_plan(self.plan, EVAL_POOLER, params=params["encoder"],
                                      head_params=params["head"])
    return sts.split_spearman(encode, self.pairs)


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
    self.manager = checkpoint.best_manager(workdir)
    self.best = self._stored_best()
    self.splits = self._plan_dev_splits() if self.enabled else {}

  def _plan_dev_splits(self) -> dict[str, PlannedPairs]:
    """STS-B dev (and SICK-R dev): read and tokenized once per run."""
    size = self.run.config.eval.batch_size
    splits = {"stsb_dev": PlannedPairs(self.encoder, senteval_data.load_stsb(self.dir)["dev"], size)}
    if self.run.config.eval.sickr_dev:
      splits["sickr_dev"] = PlannedPairs(self.encoder, senteval_data.load_sickr(self.dir)["dev"], size)
    return splits

  def _stored_best(self) -> float:
    step = self.manager.best_step()
    return float(self.manager.metrics(step)["stsb_dev"]) if step is not None else -math.inf

  def encode_fn(self, params):
    return params_encode_fn(self.encoder, params, self.run.config.eval.batch_size)

  def __call__(self, state) -> dict:
    """Dev scores of `state.params`; a new best is saved asynchronously (waited for at the end)."""
    scores = {name: split.spearman(state.params) for name, split in self.splits.items()}
    if scores["stsb_dev"] > self.best:
      self.best = scores["stsb_dev"]
      checkpoint.save_best(self.manager, int(state.step), state.params, self.best, wait=False)
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
    report.write_json(os.path.join(workdir, "results.json"), document)
    print(report.markdown_table(document))
  return document
