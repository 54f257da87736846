"""SentEval transfer tasks (MR, CR, SUBJ, MPQA, SST2, TREC, MRPC): linear probes, two protocols.

Validation schemes (SentEval's `tools/validation.py` with `usepytorch=True`, as SimCSE runs it):
* MR, CR, SUBJ, MPQA: k-fold stratified CV; inside each outer fold a k-fold inner CV picks the
  L2 value from `L2_GRID` (mean inner accuracy x100 rounded to 2 decimals, first maximum wins),
  then a model trained on the whole outer-train part is scored on the outer-test part
  (`InnerKFoldClassifier`; SentEval draws both fold levels with `random_state=1111` whatever the
  seed). Reported: the mean outer-test accuracy.
* SST2: train on train for every L2 value, pick by dev accuracy, report test (`SplitClassifier`).
* TREC, MRPC: k-fold CV on train (folds drawn with the seed) picks the L2 value; a model trained
  on all of train is scored on test (`KFoldClassifier`). MRPC features are SentEval's
  `[|u - v|, u * v]` (u, v themselves are not included); its test F1 is reported too.
* Folds: sklearn `StratifiedKFold(shuffle=True, random_state=...)` over samples in SentEval's
  order (sorted by token count, then label), so the fold assignment is SentEval's.

Protocols (`protocol=`):
* `senteval` (default): SentEval's own classifier (`senteval_classifier.py`): a linear layer on
  the raw features trained by Adam (`fast`: RMSprop) with early stopping on the inner fold,
  L2 as weight decay on all parameters, the final fits early-stopped on a random 5 % hold-out;
  10/10 folds (`fast`: SimCSE's `fasttest`, 5/5 folds and 5-fold CV).
* `logreg`: the exact L2-regularised logistic regression on standardised features with an
  unpenalised bias (`logreg.py`); deterministic, but not the papers' protocol; 10/10 folds
  (`fast`: 5 outer / 3 inner folds, 3-fold CV).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np
from sklearn.model_selection import StratifiedKFold

from micse_jax.evaluation import senteval_classifier, senteval_data
from micse_jax.evaluation.logreg import fit_predict
from micse_jax.evaluation.senteval_classifier import FitSpec
from micse_jax.evaluation.senteval_data import TRANSFER7
from micse_jax.evaluation.sts import encode_unique

EncodeFn = Callable[[list[str]], np.ndarray]
Classifier = Callable[..., np.ndarray]  # (x, y, [FitSpec], num_classes) -> predictions [F, N]
L2_GRID = (1e-5, 1e-4, 1e-3, 1e-2)
SEED = senteval_data.SEED
INNER_KFOLD_SEED = 1111  # SentEval's InnerKFoldClassifier draws its folds with this, always
PROTOCOLS = senteval_data.TRANSFER_PROTOCOLS
FULL_FOLDS = {"outer": 10, "inner": 10, "kfold": 10}
FAST_FOLDS = {"outer": 5, "inner": 3, "kfold": 3}
SENTEVAL_FAST_FOLDS = {"outer": 5, "inner": 5, "kfold": 5}


def logreg_classifier(x, y, specs: Sequence[FitSpec], num_classes: int) -> np.ndarray:
  """The `logreg` protocol: exact logistic regression on each spec's training rows."""
  return fit_predict(x, y, [s.train for s in specs], [s.l2 for s in specs], num_classes)


def senteval_classifier_for(fast: bool, seed: int) -> Classifier:
  """The `senteval` protocol: SentEval's early-stopped linear classifier (`test`/`fasttest`)."""
  settings = senteval_classifier.FASTTEST if fast else senteval_classifier.TEST
  return functools.partial(senteval_classifier.train_predict, settings=settings, seed=seed)


def protocol_folds(protocol: str, fast: bool) -> dict:
  """Outer / inner / k-fold counts of a protocol."""
  if protocol == "senteval":
    return SENTEVAL_FAST_FOLDS if fast else FULL_FOLDS
  return FAST_FOLDS if fast else FULL_FOLDS


def protocol_settings(protocol: str, fast: bool) -> dict:
  """The JSON description of a protocol: name, folds, L2 grid and classifier settings."""
  check_protocol(protocol)
  described = {"protocol": protocol, "l2_grid": list(L2_GRID),
               "folds": protocol_folds(protocol, fast)}
  if protocol == "senteval":
    settings = senteval_classifier.FASTTEST if fast else senteval_classifier.TEST
    described.update(mode="fasttest" if fast else "test", inner_kfold_seed=INNER_KFOLD_SEED,
                     classifier=dataclasses.asdict(settings),
                     holdout=senteval_classifier.VALIDATION_SPLIT)
  return described


def check_protocol(protocol: str) -> None:
  """Raises ValueError for a protocol name that is not `senteval` or `logreg`."""
  if protocol not in PROTOCOLS:
    raise ValueError(f"unknown transfer protocol {protocol!r}; expected one of "
                     f"{', '.join(PROTOCOLS)}")


# ---------------------------------------------------------------- SentEval validation schemes

def stratified_folds(y: np.ndarray, k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """SentEval's folds: `StratifiedKFold(k, shuffle=True, random_state=seed)`."""
  skf = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
  return list(skf.split(np.zeros(len(y)), y))


def _accuracy(predictions: np.ndarray, y: np.ndarray, idx: np.ndarray) -> float:
  return float(np.mean(predictions[idx] == y[idx]))


def grid_cv_scores(x, y, folds, grid, num_classes,
                   classifier: Classifier = logreg_classifier) -> np.ndarray:
  """Accuracy `[len(grid), len(folds)]` of each L2 value on each (train, eval) fold; the eval
  part is also the fit's early-stopping set (SentEval's `validation_data`)."""
  specs = [FitSpec(tr, te, reg) for reg in grid for tr, te in folds]
  predictions = classifier(x, y, specs, num_classes)
  scores = [_accuracy(p, y, folds[i % len(folds)][1]) for i, p in enumerate(predictions)]
  return np.asarray(scores).reshape(len(grid), len(folds))


def _pick(mean_scores: np.ndarray) -> int:
  """SentEval's choice: scores rounded to 2 decimals (x100), first maximum."""
  return int(np.argmax(np.round(100.0 * mean_scores, 2)))


def inner_kfold_eval(x, y, num_classes: int, outer: int, inner: int,
                     grid: Sequence[float] = L2_GRID, seed: int = SEED,
                     classifier: Classifier = logreg_classifier) -> dict:
  """SentEval `InnerKFoldClassifier`: nested CV accuracy x100 (MR, CR, SUBJ, MPQA).

  `seed` draws the folds (SentEval itself always uses 1111 here: `INNER_KFOLD_SEED`).
  """
  outer_folds = stratified_folds(y, outer, seed)
  inner_folds = [(tr[a], tr[b]) for tr, _ in outer_folds
                 for a, b in stratified_folds(y[tr], inner, seed)]
  scores = grid_cv_scores(x, y, inner_folds, grid, num_classes, classifier)
  dev = scores.reshape(len(grid), outer, inner).mean(-1)  # [grid, outer]
  best = [_pick(dev[:, o]) for o in range(outer)]
  specs = [FitSpec(tr, None, grid[i]) for (tr, _), i in zip(outer_folds, best)]
  predictions = classifier(x, y, specs, num_classes)
  test = [_accuracy(p, y, te) for p, (_, te) in zip(predictions, outer_folds)]
  return {"acc": 100.0 * float(np.mean(test)),
          "devacc": 100.0 * float(np.mean([dev[i, o] for o, i in enumerate(best)])),
          "l2": [grid[i] for i in best], "n": len(y), "folds": [outer, inner]}


def kfold_eval(x_train, y_train, x_test, y_test, num_classes: int, k: int,
               grid: Sequence[float] = L2_GRID, seed: int = SEED,
               classifier: Classifier = logreg_classifier) -> dict:
  """SentEval `KFoldClassifier`: k-fold CV on train picks L2, then test accuracy x100.

  Both stages run on train+test stacked (test rows are in no fit's training or dev rows), so
  they share one feature matrix.
  """
  x = np.concatenate([x_train, x_test])
  y = np.concatenate([y_train, y_test])
  train_idx = np.arange(len(y_train))
  scores = grid_cv_scores(x, y, stratified_folds(y_train, k, seed), grid, num_classes,
                          classifier)
  best = _pick(scores.mean(-1))
  predictions = classifier(x, y, [FitSpec(train_idx, None, grid[best])],
                           num_classes)[0][len(y_train):]
  return {"acc": 100.0 * float(np.mean(predictions == y_test)),
          "devacc": 100.0 * float(scores[best].mean()), "l2": grid[best],
          "n_train": len(y_train), "n_test": len(y_test), "folds": k,
          "predictions": predictions}


def split_eval(splits: dict, num_classes: int, grid: Sequence[float] = L2_GRID,
               classifier: Classifier = logreg_classifier) -> dict:
  """SentEval `SplitClassifier`: train on train per L2 (early-stopped on dev), pick on dev,
  report test accuracy x100 (SentEval's final refit repeats the chosen fit exactly)."""
  x = np.concatenate([splits[s][0] for s in ("train", "dev", "test")])
  y = np.concatenate([splits[s][1] for s in ("train", "dev", "test")])
  n_train, n_dev = len(splits["train"][1]), len(splits["dev"][1])
  dev_idx = np.arange(n_train, n_train + n_dev)
  test_idx = np.arange(n_train + n_dev, len(y))
  specs = [FitSpec(np.arange(n_train), dev_idx, reg) for reg in grid]
  predictions = classifier(x, y, specs, num_classes)
  dev = np.asarray([_accuracy(p, y, dev_idx) for p in predictions])
  best = _pick(dev)
  return {"acc": 100.0 * _accuracy(predictions[best], y, test_idx),
          "devacc": 100.0 * float(dev[best]), "l2": grid[best],
          "n_train": n_train, "n_dev": n_dev, "n_test": len(test_idx)}


# ---------------------------------------------------------------- tasks

def senteval_order(keys: Sequence[tuple]) -> np.ndarray:
  """The permutation SentEval applies before batching (stable sort by `keys`)."""
  return np.asarray(sorted(range(len(keys)), key=lambda i: keys[i]), dtype=np.int64)


def _ntokens(sentence: str) -> int:
  return len(sentence.split())


def _embed(encode_fn: EncodeFn, sentences: Sequence[str]) -> np.ndarray:
  embeddings, row = encode_unique(encode_fn, sentences)
  return embeddings[[row[s] for s in sentences]]


def _binary_task(encode_fn, senteval_dir, task, run):
  data = senteval_data.load_binary(senteval_dir, task)
  order = senteval_order([(_ntokens(s), int(l)) for s, l in zip(*data)])
  sentences = [data.sentences[i] for i in order]
  labels = data.labels[order]
  folds = run["folds"]
  return inner_kfold_eval(_embed(encode_fn, sentences), labels, 2, folds["outer"],
                          folds["inner"], seed=run["inner_kfold_seed"],
                          classifier=run["classifier"])


def _sst2_task(encode_fn, senteval_dir, run):
  data = senteval_data.load_sst2(senteval_dir)
  sentences = [s for split in data.values() for s in split.sentences]
  embeddings, row = encode_unique(encode_fn, sentences)
  splits = {name: (embeddings[[row[s] for s in d.sentences]], d.labels)
            for name, d in data.items()}
  return split_eval(splits, 2, classifier=run["classifier"])


def _trec_task(encode_fn, senteval_dir, run):
  data = senteval_data.load_trec(senteval_dir)
  train, test = data["train"], data["test"]
  order = senteval_order([(_ntokens(s), int(l)) for s, l in zip(*train)])
  x = _embed(encode_fn, [train.sentences[i] for i in order] + test.sentences)
  n = len(order)
  result = kfold_eval(x[:n], train.labels[order], x[n:], test.labels,
                      len(senteval_data.TREC_LABELS), run["folds"]["kfold"], seed=run["seed"],
                      classifier=run["classifier"])
  del result["predictions"]
  return result


def mrpc_features(u: np.ndarray, v: np.ndarray) -> np.ndarray:
  """SentEval's MRPC pair features `[|u - v|, u * v]`."""
  return np.concatenate([np.abs(u - v), u * v], axis=1)


def _mrpc_task(encode_fn, senteval_dir, run):
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
                      run["folds"]["kfold"], seed=run["seed"], classifier=run["classifier"])
  predictions = result.pop("predictions")
  result["f1"] = 100.0 * _f1(predictions, test.labels)
  return result


def _f1(predictions: np.ndarray, labels: np.ndarray) -> float:
  """Binary F1 of the positive class (label 1)."""
  tp = float(np.sum((predictions == 1) & (labels == 1)))
  denominator = float(np.sum(predictions == 1) + np.sum(labels == 1))
  return 2.0 * tp / denominator if denominator else 0.0


def _run_settings(protocol: str, fast: bool, seed: int) -> dict:
  """Folds, fold seeds and classifier of one protocol."""
  check_protocol(protocol)
  senteval = protocol == "senteval"
  return {"folds": protocol_folds(protocol, fast), "seed": seed,
          "inner_kfold_seed": INNER_KFOLD_SEED if senteval else seed,
          "classifier": senteval_classifier_for(fast, seed) if senteval else logreg_classifier}


def evaluate_transfer_task(encode_fn: EncodeFn, senteval_dir: str, task: str,
                           fast: bool = False, seed: int = SEED,
                           protocol: str = "senteval") -> dict:
  """Accuracy x100 (`acc`) and details of one transfer task under `protocol`."""
  run = _run_settings(protocol, fast, seed)
  if task in senteval_data.BINARY_FILES:
    return _binary_task(encode_fn, senteval_dir, task, run)
  runners = {"SST2": _sst2_task, "TREC": _trec_task, "MRPC": _mrpc_task}
  if task not in runners:
    raise ValueError(f"not a transfer task: {task!r}; transfer tasks: {', '.join(TRANSFER7)}")
  return runners[task](encode_fn, senteval_dir, run)


def evaluate_transfer(encode_fn: EncodeFn, senteval_dir: str,
                      tasks: Sequence[str] = TRANSFER7, fast: bool = False,
                      seed: int = SEED, protocol: str = "senteval") -> dict:
  """Accuracy x100 per transfer task and their average: `{'tasks', 'avg', 'protocol'}`."""
  check_protocol(protocol)
  results = {task: evaluate_transfer_task(encode_fn, senteval_dir, task, fast, seed, protocol)
             for task in tasks}
  avg = float(np.mean([r["acc"] for r in results.values()])) if results else None
  return {"tasks": results, "avg": avg, "protocol": protocol}
