"""Model selection on STS-B dev during training, and the final evaluation of the best params.

SimCSE/miCSE protocol: every `eval_every` steps the online encoder's [CLS] before the MLP head
is scored on STS-B dev (Spearman x100, `workdir.BEST_METRIC`); the trainer keeps the best
params in `workdir/best/`, and at the end they are evaluated on `eval.final_tasks` into
`workdir/results.json`.

The dev splits are read and tokenized once per run (`PlannedPairs`); each evaluation only runs
the encoder's jitted programs (compiled at the first evaluation) and scores.
"""
from __future__ import annotations

import logging
import os

import jax
import ml_collections

from micse_jax import workdir as workdir_lib
from micse_jax.encoder import SentenceEncoder
from micse_jax.evaluation import report, senteval_data, sts
from micse_jax.evaluation.runner import run_evaluation

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


class DevSelection:
  """Scores STS-B dev (and optionally SICK-R dev) of explicit params with [CLS] before the MLP.

  The SentEval directory and its tasks were checked once before the run (`config_checks.check_senteval`);
  a missing default directory only turns selection off, with a warning. Its scores are logged
  under `PREFIX` (`tagged`).
  """

  PREFIX = "eval"  # the TensorBoard tag prefix of its scores

  def __init__(self, encoder: SentenceEncoder, eval_config: ml_collections.ConfigDict, eval_every: int):
    self.dir = eval_config.senteval_dir
    self.enabled = eval_every > 0 and os.path.isdir(self.dir)
    if eval_every > 0 and not self.enabled:
      logging.warning("SentEval data not found at %s: no dev-set model selection", self.dir)
    self.encoder, self.config = encoder, eval_config
    self.splits = self._plan_dev_splits() if self.enabled else {}

  def _plan_dev_splits(self) -> dict[str, PlannedPairs]:
    """STS-B dev (and SICK-R dev): read and tokenized once per run."""
    size = self.config.batch_size
    splits = {workdir_lib.BEST_METRIC: PlannedPairs(self.encoder, senteval_data.load_stsb(self.dir)["dev"], size)}
    if self.config.sickr_dev:
      splits["sickr_dev"] = PlannedPairs(self.encoder, senteval_data.load_sickr(self.dir)["dev"], size)
    return splits

  @property
  def has_final_tasks(self) -> bool:
    """Whether `final_evaluation` has anything to do (tasks named, SentEval data present)."""
    return bool(self.config.final_tasks) and os.path.isdir(self.dir)

  def encode_fn(self, params):
    """list[str] → embeddings of `params` (`{'encoder', 'head', ...}`) with the evaluation pooler."""
    return params_encode_fn(self.encoder, params, self.config.batch_size)

  def __call__(self, params) -> dict[str, float]:
    """`{BEST_METRIC: STS-B dev Spearman x100}` (+ `sickr_dev` when `eval.sickr_dev`)."""
    return {name: split.spearman(params) for name, split in self.splits.items()}

  def compile(self, params) -> None:
    """Compiles the programs a call with params placed as `params` runs (`SentenceEncoder.compile_plan`),
    without scoring."""
    for split in self.splits.values():
      self.encoder.compile_plan(split.plan, EVAL_POOLER, params=params["encoder"], head_params=params["head"])

  def tagged(self, scores: dict[str, float]) -> dict[str, float]:
    """`scores` keyed by their TensorBoard tags (`eval/<name>`)."""
    return {f"{self.PREFIX}/{name}": value for name, value in scores.items()}


def final_evaluation(selection: DevSelection, workdir: str, params, which: str) -> dict:
  """Evaluates `params` (described by `which`) on `eval.final_tasks`; writes results.json."""
  if not selection.has_final_tasks:
    return {}
  results = run_evaluation(selection.encode_fn(params), selection.dir, selection.config.final_tasks,
                           transfer_protocol=selection.config.get("transfer_protocol", "senteval"))
  document = report.build_report(results, model=os.path.abspath(workdir), pooler=EVAL_POOLER,
                                 settings={**results["settings"], "checkpoint": which},
                                 elapsed_seconds=results["elapsed_seconds"])
  if jax.process_index() == 0:
    report.write_json(os.path.join(workdir, workdir_lib.RESULTS_FILE), document)
    print(report.markdown_table(document))
  return document
