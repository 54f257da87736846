"""Dev selection tokenizes its dev split once per run and scores exactly as the STS evaluator."""
import jax
import numpy as np
import pytest

from micse_jax import SentenceEncoder
from micse_jax.evaluation import senteval_data, sts
from micse_jax.evaluators.dev_selection import PlannedPairs, params_encode_fn


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
