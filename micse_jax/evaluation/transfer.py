"""SentEval transfer tasks (MR, CR, SUBJ, MPQA, SST2, TREC, MRPC): logistic regression probes.

Protocol (SentEval with `usepytorch=True`, `nhid=0`, `kfold=10`, as SimCSE runs it):
* MR, CR, SUBJ, MPQA: 10-fold stratified CV; inside each outer fold a 10-fold inner CV picks the
  L2 strength from `L2_GRID` (mean inner accuracy, rounded to 2 decimals, first maximum wins),
  then a model trained on the whole outer-train part is scored on the outer-test part
  (SentEval's `InnerKFoldClassifier`). Reported: the mean outer-test accuracy.
* SST2: train on train for every L2 value, pick by dev accuracy, report test (`SplitClassifier`).
* TREC, MRPC: 10-fold CV on train picks the L2 value; a model trained on all of train is scored
  on test (`KFoldClassifier`). MRPC features are SentEval's `[|u - v|, u * v]` (u, v themselves
  are not included); its test F1 is reported beside the accuracy.
* Folds: sklearn `StratifiedKFold(shuffle=True, random_state=seed)` (seed 1111, as SentEval),
  over samples in SentEval's order (sorted by token count, then label), so the fold assignment
  is SentEval's. `fast=True`: 5 outer / 3 inner folds and 3-fold CV for TREC/MRPC.

Classifier: batched L-BFGS multinomial logistic regression, `micse_jax/evaluation/logreg.py`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from sklearn.model_selection import StratifiedKFold

from micse_jax.evaluation import senteval_data
from micse_jax.evaluation.logreg import fit_predict
from micse_jax.evaluation.senteval_data import TRANSFER7
from micse_jax.evaluation.sts import encode_unique

EncodeFn = Callable[[list[str]], np.ndarray]
L2_GRID = (1e-5, 1e-4, 1e-3, 1e-2)
SEED = senteval_data.SEED
FULL_FOLDS = {"outer": 10, "inner": 10, "kfold": 10}
FAST_FOLDS = {"outer": 5, "inner": 3, "kfold": 3}


# ---------------------------------------------------------------- SentEval validation schemes

def stratified_folds(y: np.ndarray, k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """SentEval's folds: `StratifiedKFold(k, shuffle=True, random_state=seed)`."""
  skf = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
  return list(skf.split(np.zeros(len(y)), y))


def _accuracy(predictions: np.ndarray, y: np.ndarray, idx: np.ndarray) -> float:
  return float(np.mean(predictions[idx] == y[idx]))


def grid_cv_scores(x, y, folds, grid, num_classes) -> np.ndarray:
  """Accuracy `[len(grid), len(folds)]` of each L2 value on each (train, eval) fold."""
  trains = [tr for _ in grid for tr, _ in folds]
  l2s = [reg for reg in grid for _ in folds]
  predictions = fit_predict(x, y, trains, l2s, num_classes)
  scores = [_accuracy(p, y, folds[i % len(folds)][1]) for i, p in enumerate(predictions)]
  return np.asarray(scores).reshape(len(grid), len(folds))


def _pick(mean_scores: np.ndarray) -> int:
  """SentEval's choice: scores rounded to 2 decimals (x100), first maximum."""
  return int(np.argmax(np.round(100.0 * mean_scores, 2)))


def inner_kfold_eval(x, y, num_classes: int, outer: int, inner: int,
                     grid: Sequence[float] = L2_GRID, seed: int = SEED) -> dict:
  """SentEval `InnerKFoldClassifier`: nested CV accuracy x100 (MR, CR, SUBJ, MPQA)."""
  outer_folds = stratified_folds(y, outer, seed)
  inner_folds = [(tr[a], tr[b]) for tr, _ in outer_folds
                 for a, b in stratified_folds(y[tr], inner, seed)]
  scores = grid_cv_scores(x, y, inner_folds, grid, num_classes)
  dev = scores.reshape(len(grid), outer, inner).mean(-1)  # [grid, outer]
  best = [_pick(dev[:, o]) for o in range(outer)]
  predictions = fit_predict(x, y, [tr for tr, _ in outer_folds], [grid[i] for i in best],
                            num_classes)
  test = [_accuracy(p, y, te) for p, (_, te) in zip(predictions, outer_folds)]
  return {"acc": 100.0 * float(np.mean(test)),
          "devacc": 100.0 * float(np.mean([dev[i, o] for o, i in enumerate(best)])),
          "l2": [grid[i] for i in best], "n": int(len(y)), "folds": [outer, inner]}


def kfold_eval(x_train, y_train, x_test, y_test, num_classes: int, k: int,
               grid: Sequence[float] = L2_GRID, seed: int = SEED) -> dict:
  """SentEval `KFoldClassifier`: k-fold CV on train picks L2, then test accuracy x100.

  Both stages run on train+test stacked (test rows get weight 0 in every CV fit), so they
  share one compiled shape.
  """
  x = np.concatenate([x_train, x_test])
  y = np.concatenate([y_train, y_test])
  train_idx = np.arange(len(y_train))
  scores = grid_cv_scores(x, y, stratified_folds(y_train, k, seed), grid, num_classes)
  best = _pick(scores.mean(-1))
  predictions = fit_predict(x, y, [train_idx], [grid[best]], num_classes)[0][len(y_train):]
  return {"acc": 100.0 * float(np.mean(predictions == y_test)),
          "devacc": 100.0 * float(scores[best].mean()), "l2": grid[best],
          "n_train": int(len(y_train)), "n_test": int(len(y_test)), "folds": k,
          "predictions": predictions}


def split_eval(splits: dict, num_classes: int, grid: Sequence[float] = L2_GRID) -> dict:
  """SentEval `SplitClassifier`: train on train per L2, pick on dev, report test accuracy x100."""
  x = np.concatenate([splits[s][0] for s in ("train", "dev", "test")])
  y = np.concatenate([splits[s][1] for s in ("train", "dev", "test")])
  n_train, n_dev = len(splits["train"][1]), len(splits["dev"][1])
  dev_idx = np.arange(n_train, n_train + n_dev)
  test_idx = np.arange(n_train + n_dev, len(y))
  predictions = fit_predict(x, y, [np.arange(n_train)] * len(grid), list(grid), num_classes)
  dev = np.asarray([_accuracy(p, y, dev_idx) for p in predictions])
  best = _pick(dev)
  return {"acc": 100.0 * _accuracy(predictions[best], y, test_idx),
          "devacc": 100.0 * float(dev[best]), "l2": grid[best],
          "n_train": n_train, "n_dev": n_dev, "n_test": int(len(test_idx))}


# ---------------------------------------------------------------- tasks

def senteval_order(keys: Sequence[tuple]) -> np.ndarray:
  """The permutation SentEval applies before batching (stable sort by `keys`)."""
  return np.asarray(sorted(range(len(keys)), key=lambda i: keys[i]), dtype=np.int64)


def _ntokens(sentence: str) -> int:
  return len(sentence.split())


def _embed(encode_fn: EncodeFn, sentences: Sequence[str]) -> np.ndarray:
  embeddings, row = encode_unique(encode_fn, sentences)
  return embeddings[[row[s] for s in sentences]]


def _binary_task(encode_fn, senteval_dir, task, folds, seed):
  data = senteval_data.load_binary(senteval_dir, task)
  order = senteval_order([(_ntokens(s), int(l)) for s, l in zip(*data)])
  sentences = [data.sentences[i] for i in order]
  labels = data.labels[order]
  return inner_kfold_eval(_embed(encode_fn, sentences), labels, 2, folds["outer"],
                          folds["inner"], seed=seed)


def _sst2_task(encode_fn, senteval_dir, folds, seed):
  del folds, seed  # fixed train/dev/test split
  data = senteval_data.load_sst2(senteval_dir)
  sentences = [s for split in data.values() for s in split.sentences]
  embeddings, row = encode_unique(encode_fn, sentences)
  splits = {name: (embeddings[[row[s] for s in d.sentences]], d.labels)
            for name, d in data.items()}
  return split_eval(splits, 2)


def _trec_task(encode_fn, senteval_dir, folds, seed):
  data = senteval_data.load_trec(senteval_dir)
  train, test = data["train"], data["test"]
  order = senteval_order([(_ntokens(s), int(l)) for s, l in zip(*train)])
  x = _embed(encode_fn, [train.sentences[i] for i in order] + test.sentences)
  n = len(order)
  result = kfold_eval(x[:n], train.labels[order], x[n:], test.labels,
                      len(senteval_data.TREC_LABELS), folds["kfold"], seed=seed)
  del result["predictions"]
  return result


def mrpc_features(u: np.ndarray, v: np.ndarray) -> np.ndarray:
  """SentEval's MRPC pair features `[|u - v|, u * v]`."""
  return np.concatenate([np.abs(u - v), u * v], axis=1)


def _mrpc_task(encode_fn, senteval_dir, folds, seed):
  data = senteval_data.load_mrpc(senteval_dir)
  train, test = data["train"], data["test"]
  order = senteval_order([(_ntokens(a), _ntokens(b), int(l)) for a, b, l in zip(*train)])
  first = [train.sentences1[i] for i in order] + test.sentences1
  second = [train.sentences2[i] for i in order] + test.sentences2
  embeddings, row = encode_unique(encode_fn, first + second)
  features = mrpc_features(embeddings[[row[s] for s in first]],
                           embeddings[[row[s] for s in second]])
  n = len(order)
  result = kfold_eval(features[:n], train.labels[order], features[n:], test.labels, 2,
                      folds["kfold"], seed=seed)
  predictions = result.pop("predictions")
  result["f1"] = 100.0 * _f1(predictions, test.labels)
  return result


def _f1(predictions: np.ndarray, labels: np.ndarray) -> float:
  """Binary F1 of the positive class (label 1)."""
  tp = float(np.sum((predictions == 1) & (labels == 1)))
  denominator = float(np.sum(predictions == 1) + np.sum(labels == 1))
  return 2.0 * tp / denominator if denominator else 0.0


def evaluate_transfer_task(encode_fn: EncodeFn, senteval_dir: str, task: str,
                           fast: bool = False, seed: int = SEED) -> dict:
  """Accuracy x100 (`acc`) and details of one transfer task."""
  folds = FAST_FOLDS if fast else FULL_FOLDS
  if task in senteval_data.BINARY_FILES:
    return _binary_task(encode_fn, senteval_dir, task, folds, seed)
  runners = {"SST2": _sst2_task, "TREC": _trec_task, "MRPC": _mrpc_task}
  if task not in runners:
    raise ValueError(f"not a transfer task: {task!r}; transfer tasks: {', '.join(TRANSFER7)}")
  return runners[task](encode_fn, senteval_dir, folds, seed)


def evaluate_transfer(encode_fn: EncodeFn, senteval_dir: str,
                      tasks: Sequence[str] = TRANSFER7, fast: bool = False,
                      seed: int = SEED) -> dict:
  """Accuracy x100 for each transfer task and their average: `{'tasks': {...}, 'avg': float}`."""
  results = {task: evaluate_transfer_task(encode_fn, senteval_dir, task, fast, seed)
             for task in tasks}
  avg = float(np.mean([r["acc"] for r in results.values()])) if results else None
  return {"tasks": results, "avg": avg}
