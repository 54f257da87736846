"""Transfer tasks: the batched JAX logistic regression against scikit-learn, SentEval CV schemes."""
import os

import jax
import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold

from micse_jax.evaluation import logreg, transfer


def _blobs(n, dim, classes, seed, spread=1.0, flip=0.0):
  """Gaussian classes with shifted, scaled features; labels optionally flipped at random."""
  rng = np.random.default_rng(seed)
  y = rng.integers(0, classes, n)
  centers = rng.normal(size=(classes, dim)) * spread
  x = centers[y] + rng.normal(size=(n, dim))
  x = x * rng.uniform(0.5, 5.0, dim) + rng.normal(size=dim) * 3  # unstandardised features
  flipped = rng.random(n) < flip
  y = np.where(flipped, rng.integers(0, classes, n), y)
  return x.astype(np.float32), y


def _softmax(z):
  z = z - z.max(1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(1, keepdims=True)


def _sklearn_probs(x, y, train, l2, binary):
  """sklearn on the same objective: features standardised with the training rows' moments;
  mean CE + l2/2 |W|^2 is C = 1/(n l2) for multinomial, C = 2/(n l2) for one binary logit."""
  mean, std = x[train].mean(0), x[train].std(0)
  n = len(train)
  clf = LogisticRegression(C=(2.0 if binary else 1.0) / (n * l2), tol=1e-10, max_iter=10000)
  clf.fit((x[train] - mean) / std, y[train])
  return clf.predict_proba((x - mean) / std)


@pytest.mark.parametrize("classes", [2, 3])
def test_logreg_matches_sklearn(classes):
  x, y = _blobs(240, 6, classes, seed=classes, spread=0.7)
  trains = [np.arange(0, 180), np.arange(60, 240), np.arange(0, 240, 2)]
  l2s = [1e-2, 1e-3, 1e-1]
  weights = np.zeros((3, len(y)), np.float32)
  for row, idx in enumerate(trains):
    weights[row, idx] = 1
  w, b = logreg.fit_logreg(x, y, weights, np.float32(l2s), num_classes=classes)
  w, b = np.asarray(w), np.asarray(b)
  for fit, (train, l2) in enumerate(zip(trains, l2s)):
    ours = _softmax(x.astype(np.float64) @ w[fit] + b[fit])
    theirs = _sklearn_probs(x, y, train, l2, binary=classes == 2)
    np.testing.assert_allclose(ours, theirs, atol=2e-3)
  predictions = np.asarray(logreg.predict_logreg(x, w, b))
  np.testing.assert_array_equal(predictions[0], np.argmax(x @ w[0] + b[0], axis=1))


def test_stratified_folds_are_sentevals():
  y = np.array([0, 1] * 25 + [1] * 10)
  folds = transfer.stratified_folds(y, 5, 1111)
  expected = StratifiedKFold(n_splits=5, shuffle=True, random_state=1111).split(np.zeros(60), y)
  for (tr, te), (etr, ete) in zip(folds, expected):
    np.testing.assert_array_equal(tr, etr)
    np.testing.assert_array_equal(te, ete)
  assert sorted(np.concatenate([te for _, te in folds]).tolist()) == list(range(60))


def _sklearn_nested_cv(x, y, outer, inner, grid, seed):
  """SentEval InnerKFoldClassifier semantics, computed with sklearn."""
  accs = []
  for tr, te in StratifiedKFold(outer, shuffle=True, random_state=seed).split(x, y):
    scores = []
    for l2 in grid:
      inner_acc = []
      for a, b in StratifiedKFold(inner, shuffle=True, random_state=seed).split(x[tr], y[tr]):
        probs = _sklearn_probs(x, y, tr[a], l2, binary=True)
        inner_acc.append(np.mean(probs[tr[b]].argmax(1) == y[tr[b]]))
      scores.append(round(100 * np.mean(inner_acc), 2))
    best = grid[int(np.argmax(scores))]
    probs = _sklearn_probs(x, y, tr, best, binary=True)
    accs.append(np.mean(probs[te].argmax(1) == y[te]))
  return 100 * np.mean(accs)


def test_inner_kfold_on_separable_and_noisy_data():
  x, y = _blobs(400, 8, 2, seed=7, spread=4.0)
  separable = transfer.inner_kfold_eval(x, y, 2, outer=5, inner=3)
  assert separable["acc"] >= 99.0
  assert len(separable["l2"]) == 5 and set(separable["l2"]) <= set(transfer.L2_GRID)
  x, y = _blobs(400, 8, 2, seed=7, spread=4.0, flip=0.4)  # ~20% wrong labels: ~80% accuracy
  noisy = transfer.inner_kfold_eval(x, y, 2, outer=5, inner=3)
  assert 72.0 <= noisy["acc"] <= 88.0
  reference = _sklearn_nested_cv(x, y, 5, 3, transfer.L2_GRID, 1111)
  assert noisy["acc"] == pytest.approx(reference, abs=1.5)


def test_kfold_and_split_eval():
  x, y = _blobs(300, 8, 3, seed=3, spread=1.5)
  result = transfer.kfold_eval(x[:200], y[:200], x[200:], y[200:], 3, k=3)
  assert result["l2"] in transfer.L2_GRID and result["n_test"] == 100
  probs = _sklearn_probs(x, y, np.arange(200), result["l2"], binary=False)
  reference = 100 * np.mean(probs[200:].argmax(1) == y[200:])
  assert result["acc"] == pytest.approx(reference, abs=2.0)
  splits = {"train": (x[:200], y[:200]), "dev": (x[200:250], y[200:250]),
            "test": (x[250:], y[250:])}
  split = transfer.split_eval(splits, 3)
  assert split["n_test"] == 50 and 0 <= split["acc"] <= 100 and split["devacc"] > 60


def test_fit_predict_chunks_give_same_predictions(monkeypatch):
  x, y = _blobs(200, 5, 2, seed=11, spread=1.0)
  trains = [np.arange(i, 200, 3) for i in range(3)] + [np.arange(200)] * 2
  l2s = [1e-3, 1e-2, 1e-4, 1e-3, 1e-2]
  whole = logreg.fit_predict(x, y, trains, l2s, 2)
  monkeypatch.setattr(logreg, "FIT_BATCH_ENTRIES", 2 * 200 * 2)  # chunks of 2 fits
  np.testing.assert_array_equal(logreg.fit_predict(x, y, trains, l2s, 2), whole)


def test_mrpc_features_are_sentevals():
  u = np.array([[1.0, -2.0]])
  v = np.array([[3.0, 1.0]])
  np.testing.assert_array_equal(transfer.mrpc_features(u, v), [[2.0, 3.0, 3.0, -2.0]])


def test_senteval_order_is_stable_sort():
  keys = [(3, 1), (1, 0), (3, 0), (1, 0)]
  assert transfer.senteval_order(keys).tolist() == [1, 3, 2, 0]


# ------------------------------------------------------------------ end to end, tiny data

WORDS = {0: ["dull", "bad", "boring"], 1: ["great", "fine", "good"]}


def _sentence(rng, label, n_filler=4):
  filler = [f"w{int(i)}" for i in rng.integers(0, 30, n_filler)]
  return " ".join(filler + [WORDS[label][int(rng.integers(0, 3))]])


def _tiny_transfer_dir(root, n=60, seed=0):
  """All seven transfer tasks with `n`-ish sentences whose label is a keyword."""
  rng = np.random.default_rng(seed)
  def write(rel, lines, encoding="utf-8"):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding=encoding) as f:
      f.write("\n".join(lines) + "\n")
  for folder, pos, neg in [("MR", "rt-polarity.pos", "rt-polarity.neg"),
                           ("CR", "custrev.pos", "custrev.neg"),
                           ("SUBJ", "subj.objective", "subj.subjective"),
                           ("MPQA", "mpqa.pos", "mpqa.neg")]:
    write(f"{folder}/{pos}", [_sentence(rng, 1) for _ in range(n // 2)], "latin-1")
    write(f"{folder}/{neg}", [_sentence(rng, 0) for _ in range(n // 2)], "latin-1")
  for split, size in [("train", n), ("dev", n // 2), ("test", n // 2)]:
    labels = rng.integers(0, 2, size)
    write(f"SST/binary/sentiment-{split}", [f"{_sentence(rng, l)} \t{l}" for l in labels])
  coarse = ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]
  for name, size in [("train_5500.label", n), ("TREC_10.label", n // 2)]:
    labels = np.arange(size) % 6
    write(f"TREC/{name}", [f"{coarse[l]}:x w{l}x what {_sentence(rng, 0, 2)} ?"
                           for l in labels], "latin-1")
  for split, size in [("train", n), ("test", n // 2)]:
    rows = ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
    for i in range(size):
      label = i % 2
      first = _sentence(rng, 1)
      second = first if label else _sentence(rng, 0)
      rows.append(f"{label}\t{i}\t{i + 1000}\t{first}\t{second}")
    write(f"MRPC/msr_paraphrase_{split}.txt", rows)


def _keyword_encoder(sentences):
  """Keyword, TREC-marker and a few hashed filler features; deterministic."""
  vocab = WORDS[0] + WORDS[1] + [f"w{l}x" for l in range(6)]
  out = np.zeros((len(sentences), len(vocab) + 4), np.float32)
  for row, sentence in enumerate(sentences):
    for token in sentence.split():
      if token in vocab:
        out[row, vocab.index(token)] += 1
      else:
        out[row, len(vocab) + sum(map(ord, token)) % 4] += 0.1
  return out


@pytest.mark.parametrize("protocol,folds,least", [
    ("logreg", [5, 3], 95.0),
    # SentEval's final fits early-stop on 5 % of 48 rows (2 rows): noisier on tiny data
    pytest.param("senteval", [5, 5], 80.0, marks=pytest.mark.slow)])
def test_evaluate_transfer_end_to_end(tmp_path, protocol, folds, least):
  _tiny_transfer_dir(str(tmp_path))
  result = transfer.evaluate_transfer(_keyword_encoder, str(tmp_path), fast=True,
                                      protocol=protocol)
  tasks = result["tasks"]
  assert list(tasks) == list(transfer.TRANSFER7) and result["protocol"] == protocol
  for name in ("MR", "CR", "SUBJ", "MPQA", "SST2", "TREC"):
    assert tasks[name]["acc"] >= least, (name, tasks[name])
  assert tasks["MR"]["folds"] == folds and tasks["TREC"]["folds"] == folds[1]
  assert 0.0 <= tasks["MRPC"]["acc"] <= 100.0 and "f1" in tasks["MRPC"]
  assert result["avg"] == pytest.approx(np.mean([t["acc"] for t in tasks.values()]))
  assert jax.numpy.isfinite(result["avg"])
