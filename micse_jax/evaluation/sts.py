"""Unsupervised STS, SimCSE protocol: cosine of the two embeddings vs gold, Spearman x100.

* STS12-16: every subset of the year is scored; the headline number is the "all" setting (the
  pairs of all subsets concatenated, one Spearman), as SimCSE reports it. "wmean" (subset
  Spearman weighted by subset size) and "mean" are reported too.
* STSBenchmark and SICKRelatedness are used as unsupervised cosine tasks: the headline number is
  the test split's Spearman. Their dev splits (STS-B dev, SICK_trial) are exposed for model
  selection by `stsb_dev_spearman` / `sickr_dev_spearman`.

All unique sentences of a task go to the encode function in one call (it batches by length).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
from scipy import stats

from micse_jax.evaluation import senteval_data
from micse_jax.evaluation.senteval_data import STS7, SentencePairs

EncodeFn = Callable[[list[str]], np.ndarray]


def encode_unique(encode_fn: EncodeFn, sentences: Sequence[str]) -> tuple[np.ndarray, dict]:
  """Embeds each distinct sentence once; returns `(embeddings [u, dim], sentence -> row)`."""
  unique = list(dict.fromkeys(sentences))
  embeddings = np.asarray(encode_fn(unique))
  if embeddings.ndim != 2 or embeddings.shape[0] != len(unique):
    raise ValueError(f"encode function returned shape {embeddings.shape} for {len(unique)} "
                     "sentences; expected [n, dim]")
  return embeddings.astype(np.float32), {s: i for i, s in enumerate(unique)}


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Row-wise cosine similarity; 0 where a vector is zero (SentEval's nan_to_num)."""
  dots = np.sum(a * b, axis=1)
  norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.nan_to_num(dots / norms)


def spearman100(predicted: np.ndarray, gold: np.ndarray) -> float:
  """Spearman rank correlation x100 (scipy.stats.spearmanr)."""
  return float(100.0 * stats.spearmanr(predicted, gold).statistic)


def score_subsets(encode_fn: EncodeFn,
                  subsets: Mapping[str, SentencePairs]) -> dict[str, np.ndarray]:
  """Cosine similarity of every pair of every subset, with one encode call for all of them."""
  sentences = [s for p in subsets.values() for s in p.sentences1 + p.sentences2]
  embeddings, row = encode_unique(encode_fn, sentences)
  embeddings = embeddings.astype(np.float64)
  cosines = {}
  for name, pairs in subsets.items():
    first = embeddings[[row[s] for s in pairs.sentences1]]
    second = embeddings[[row[s] for s in pairs.sentences2]]
    cosines[name] = cosine_rows(first, second)
  return cosines


def aggregate_subsets(cosines: Mapping[str, np.ndarray],
                      subsets: Mapping[str, SentencePairs]) -> dict:
  """SentEval's per-subset, 'all', 'wmean' and 'mean' Spearman (x100) of one STS year."""
  per_subset = {name: {"spearman": spearman100(cosines[name], subsets[name].scores),
                       "n": len(subsets[name].scores)} for name in subsets}
  values = np.array([r["spearman"] for r in per_subset.values()])
  sizes = np.array([r["n"] for r in per_subset.values()])
  everything = spearman100(np.concatenate([cosines[n] for n in subsets]),
                           np.concatenate([subsets[n].scores for n in subsets]))
  return {"spearman": everything, "all": everything,
          "wmean": float(np.average(values, weights=sizes)), "mean": float(np.mean(values)),
          "n": int(sizes.sum()), "subsets": per_subset}


def evaluate_sts_year(encode_fn: EncodeFn, senteval_dir: str, task: str) -> dict:
  """One of STS12-16; `spearman` is the 'all' setting."""
  subsets = senteval_data.load_sts_year(senteval_dir, task)
  return aggregate_subsets(score_subsets(encode_fn, subsets), subsets)


def split_spearman(encode_fn: EncodeFn, pairs: SentencePairs) -> float:
  """Spearman x100 of cosine similarity vs gold on one split."""
  cosines = score_subsets(encode_fn, {"split": pairs})["split"]
  return spearman100(cosines, pairs.scores)


def evaluate_sts_split_task(encode_fn: EncodeFn, senteval_dir: str, task: str,
                            split: str = "test") -> dict:
  """STSBenchmark or SICKRelatedness as an unsupervised task on one split."""
  pairs = senteval_data.load_sts_task(senteval_dir, task)[split]
  return {"spearman": split_spearman(encode_fn, pairs), "n": len(pairs.scores), "split": split}


def evaluate_sts(encode_fn: EncodeFn, senteval_dir: str,
                 tasks: Sequence[str] = STS7) -> dict:
  """Spearman x100 for each STS task and their average: `{'tasks': {...}, 'avg': float}`."""
  results = {}
  for task in tasks:
    if task in senteval_data.STS_YEARS:
      results[task] = evaluate_sts_year(encode_fn, senteval_dir, task)
    elif task in STS7:
      results[task] = evaluate_sts_split_task(encode_fn, senteval_dir, task)
    else:
      raise ValueError(f"not an STS task: {task!r}; STS tasks: {', '.join(STS7)}")
  avg = float(np.mean([r["spearman"] for r in results.values()])) if results else None
  return {"tasks": results, "avg": avg}


def stsb_dev_spearman(encode_fn: EncodeFn, senteval_dir: str) -> float:
  """STS-B dev Spearman x100 (the model-selection metric of SimCSE / miCSE)."""
  return split_spearman(encode_fn, senteval_data.load_stsb(senteval_dir)["dev"])


def sickr_dev_spearman(encode_fn: EncodeFn, senteval_dir: str) -> float:
  """SICK-R dev (SICK_trial) Spearman x100."""
  return split_spearman(encode_fn, senteval_data.load_sickr(senteval_dir)["dev"])
