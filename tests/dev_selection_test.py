"""Dev selection tokenizes its dev split once per run and scores exactly as the STS evaluator."""
import jax
import numpy as np
import pytest

from micse_jax import SentenceEncoder
from micse_jax.evaluation import senteval_data, sts
from micse_jax.evaluation.evaluators.dev_selection import PlannedPairs, params_encode_fn


@pytest.fixture(scope="module")
def encoder(tiny_real_dir):
  return SentenceEncoder.from_pretrained(tiny_real_dir)


def test_planned_dev_split_scores_like_sts_and_tokenizes_once(encoder, senteval_dir, monkeypatch):
  params = {"encoder": encoder.params, "head": None}
  want = sts.stsb_dev_spearman(params_encode_fn(encoder, params, 64), senteval_dir)  # tokenizes per call
  split = PlannedPairs(encoder, senteval_data.load_stsb(senteval_dir)["dev"], 64)
  calls = []
  real = encoder.tokenizer.token_ids
  monkeypatch.setattr(encoder.tokenizer, "token_ids", lambda *a, **k: calls.append(1) or real(*a, **k))
  assert split.spearman(params) == want
  other = {"encoder": jax.tree.map(lambda x: x * 0.5 if x.ndim == 2 else x, encoder.params), "head": None}
  changed = split.spearman(other)
  assert changed != want and np.isfinite(changed)  # scores follow the params, not a cache
  assert changed == sts.stsb_dev_spearman(params_encode_fn(encoder, other, 64), senteval_dir)
  assert len(calls) == 1  # only the independent reference above tokenized again


def test_each_evaluator_tags_its_own_scalars():
  """TensorBoard tags come from the evaluator that made the value (`DevSelection.PREFIX`,
  `heldout.PREFIX`), not from its name: a training metric named like `dev...` stays `train/`."""
  from micse_jax.evaluation.evaluators.dev_selection import DevSelection
  from micse_jax.training import summaries

  class Writer:
    def __init__(self):
      self.tags = []

    def add_scalar(self, tag, value, step):
      self.tags.append((tag, value, step))

    def flush(self):
      pass

  selection = DevSelection.__new__(DevSelection)  # tagging needs no data
  writer = Writer()
  scalars = {**selection.tagged({"stsb_dev_spearman": 80.0, "sickr_dev": 70.0}), "devices_seen": 4.0,
             "loss": 1.5, "analysis/alignment": 0.25}
  summaries.write_scalars(writer, 7, scalars)
  assert writer.tags == [("eval/stsb_dev_spearman", 80.0, 7), ("eval/sickr_dev", 70.0, 7),
                         ("train/devices_seen", 4.0, 7), ("train/loss", 1.5, 7), ("analysis/alignment", 0.25, 7)]
