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

Classifier: a full-batch multinomial logistic regression minimising
`mean cross-entropy + l2 / 2 * ||W||^2` (bias not penalised) on features standardised per fit
with the training rows' mean and standard deviation (so one L2 grid suits every encoder's
scale; the standardisation is folded into the returned weights), solved by L-BFGS with Armijo
backtracking until the gradient norm is below `TOL`, the line search stalls (float32 floor) or
`MAX_ITER` steps. SentEval instead trains the same linear model with Adam, weight decay and early
stopping on a held-out split; solving the convex problem makes results deterministic and free
of optimiser settings.

Why JAX rather than scikit-learn: one 10x10-fold task is 410 fits. They are stacked as sample
weights `[fits, N]` over one shared feature matrix and solved together by `vmap` under one `jit`,
so every step is one wide matrix product `[N, D] x [D, fits * classes]` (on CPU in chunks of
about 1M `fits * N * classes` entries; beyond that XLA:CPU slows down sharply). On MR with
384-d features that is ~3x faster than 410 sequential sklearn lbfgs fits on 2 CPU cores, and it
runs unchanged on GPU/TPU. The solver is a small L-BFGS written here rather than
`optax.lbfgs`: under `vmap` the zoom line search's branches all execute, which measured ~13x the
cost of one objective evaluation per step. scikit-learn's `LogisticRegression` (same objective
with `C = 1 / (n * l2)`) is the independent check in the tests.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.model_selection import StratifiedKFold

from micse_jax.evaluation import senteval_data
from micse_jax.evaluation.senteval_data import TRANSFER7
from micse_jax.evaluation.sts import encode_unique

EncodeFn = Callable[[list[str]], np.ndarray]
L2_GRID = (1e-5, 1e-4, 1e-3, 1e-2)
MAX_ITER = 150
TOL = 1e-4
FIT_BATCH_ENTRIES = 1 << 20
MAX_FITS_PER_CALL = 64
SEED = senteval_data.SEED
FULL_FOLDS = {"outer": 10, "inner": 10, "kfold": 10}
FAST_FOLDS = {"outer": 5, "inner": 3, "kfold": 3}


# ---------------------------------------------------------------- classifier (batched fits)

class _SolverState(NamedTuple):
  params: jax.Array
  value: jax.Array
  grad: jax.Array
  s_hist: jax.Array  # [memory, *params.shape] parameter steps
  y_hist: jax.Array  # [memory, *params.shape] gradient changes
  rho: jax.Array  # [memory] 1 / (s . y); 0 marks an empty slot
  pairs: jax.Array  # number of (s, y) pairs stored so far
  step: jax.Array
  done: jax.Array


def _lbfgs_direction(state: _SolverState) -> jax.Array:
  """-H g by the two-loop recursion over the circular (s, y) memory."""
  memory = state.rho.shape[0]
  newest = (state.pairs - 1) % memory

  def backward(i, carry):
    q, alphas = carry
    j = (state.pairs - 1 - i) % memory
    alpha = state.rho[j] * jnp.vdot(state.s_hist[j], q)
    return q - alpha * state.y_hist[j], alphas.at[j].set(alpha)

  q, alphas = jax.lax.fori_loop(0, memory, backward, (state.grad, jnp.zeros_like(state.rho)))
  s, y = state.s_hist[newest], state.y_hist[newest]
  gamma = jnp.where(state.pairs > 0, jnp.vdot(s, y) / jnp.maximum(jnp.vdot(y, y), 1e-30),
                    1.0 / jnp.maximum(jnp.linalg.norm(state.grad), 1e-30))

  def forward(i, r):
    j = (state.pairs + i) % memory  # oldest first
    beta = state.rho[j] * jnp.vdot(state.y_hist[j], r)
    return r + state.s_hist[j] * (alphas[j] - beta)

  return -jax.lax.fori_loop(0, memory, forward, gamma * q)


def _line_search(value_and_grad, state: _SolverState, direction, slope, max_halvings: int):
  """Armijo backtracking from step 1: returns (step, value, grad, halvings).

  The loop starts at step 2 with an infinite value so that step 1 is its first trial (one copy
  of the objective in the compiled program). Finished fits do not backtrack: under `vmap` they
  would hold the whole batch in the loop.
  """
  def too_high(c):
    t, v, _, i = c
    first = i < 0
    return first | (~state.done & ~(v <= state.value + 1e-4 * t * slope) & (i < max_halvings))

  def halve(c):
    t, _, _, i = c
    v, g = value_and_grad(state.params + 0.5 * t * direction)
    return 0.5 * t, v, g, i + 1

  start = (jnp.full((), 2.0, direction.dtype), jnp.full((), jnp.inf, direction.dtype),
           state.grad, jnp.full((), -1, jnp.int32))
  return jax.lax.while_loop(too_high, halve, start)


def _minimize(objective, params, max_iter: int, tol, memory: int = 10, max_halvings: int = 20):
  """L-BFGS with Armijo backtracking until ||grad|| < tol, no progress, or `max_iter` steps.

  Written for `vmap`: every step has the same structure (one value-and-grad per line-search
  trial, and step 1 is almost always accepted), so a batch of fits advances in lock step.
  """
  value_and_grad = jax.value_and_grad(objective)
  value, grad = value_and_grad(params)
  hist = jnp.zeros((memory,) + params.shape, params.dtype)
  state = _SolverState(params, value, grad, hist, hist, jnp.zeros((memory,), params.dtype),
                       jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                       jnp.linalg.norm(grad) < tol)

  def body(state: _SolverState) -> _SolverState:
    direction = _lbfgs_direction(state)
    slope = jnp.vdot(state.grad, direction)
    descent = slope < 0  # else fall back to steepest descent
    direction = jnp.where(descent, direction, -state.grad)
    slope = jnp.where(descent, slope, -jnp.vdot(state.grad, state.grad))
    t, value, grad, halvings = _line_search(value_and_grad, state, direction, slope,
                                            max_halvings)
    accepted = (halvings < max_halvings) & (value < state.value)
    s, y = t * direction, grad - state.grad
    sy = jnp.vdot(s, y)
    store = accepted & (sy > 1e-10)
    slot = state.pairs % memory
    return _SolverState(
        params=jnp.where(accepted, state.params + s, state.params),
        value=jnp.where(accepted, value, state.value),
        grad=jnp.where(accepted, grad, state.grad),
        s_hist=jnp.where(store, state.s_hist.at[slot].set(s), state.s_hist),
        y_hist=jnp.where(store, state.y_hist.at[slot].set(y), state.y_hist),
        rho=jnp.where(store, state.rho.at[slot].set(1.0 / jnp.where(store, sy, 1.0)), state.rho),
        pairs=state.pairs + store.astype(jnp.int32),
        step=state.step + 1,
        done=~accepted | (jnp.linalg.norm(grad) < tol))

  state = jax.lax.while_loop(lambda st: ~st.done & (st.step < max_iter), body, state)
  return state.params


def _fit_one(x, onehot, weights, l2, max_iter, tol):
  """One weighted, standardised, L2-penalised fit; returns `(W, b)` on the raw features."""
  n = jnp.maximum(weights.sum(), 1.0)
  mean = weights @ x / n
  var = weights @ (x * x) / n - mean * mean
  inv_std = jnp.where(var > 1e-12, jax.lax.rsqrt(jnp.maximum(var, 1e-12)), 1.0)

  def raw(params):
    w_raw = params[:-1] * inv_std[:, None]  # the last row of params is the bias
    return w_raw, params[-1] - mean @ w_raw

  def objective(params):
    w_raw, b_raw = raw(params)
    log_probs = jax.nn.log_softmax(x @ w_raw + b_raw)
    nll = -(onehot * log_probs).sum(-1)
    return weights @ nll / n + 0.5 * l2 * jnp.sum(params[:-1] ** 2)

  init = jnp.zeros((x.shape[1] + 1, onehot.shape[1]), x.dtype)
  return raw(_minimize(objective, init, max_iter, tol))


@functools.partial(jax.jit, static_argnames=("num_classes", "max_iter"))
def fit_logreg(x, y, weights, l2, num_classes: int, max_iter: int = MAX_ITER, tol: float = TOL):
  """Fits `F` logistic regressions at once on shared features.

  Args:
    x: float32 `[N, D]` features.
    y: int `[N]` labels in `[0, num_classes)`.
    weights: float32 `[F, N]` per-fit sample weights (1 = training row of that fit, 0 = unused).
    l2: float32 `[F]` L2 strength of each fit.
    num_classes: number of classes.
    max_iter: L-BFGS step limit.
    tol: gradient-norm tolerance.

  Returns:
    `(W [F, D, C], b [F, C])` acting on the raw (unstandardised) features.
  """
  x = jnp.asarray(x, jnp.float32)
  center = x.mean(0)  # numerically kinder moments; undone below
  xc = x - center
  onehot = jax.nn.one_hot(y, num_classes, dtype=jnp.float32)
  fit = functools.partial(_fit_one, xc, onehot, max_iter=max_iter, tol=tol)
  w, b = jax.vmap(fit)(jnp.asarray(weights, jnp.float32), jnp.asarray(l2, jnp.float32))
  return w, b - jnp.einsum("d,fdc->fc", center, w)


@jax.jit
def predict_logreg(x, w, b):
  """Class predictions `[F, N]` of `F` fitted models."""
  return jnp.argmax(jnp.einsum("nd,fdc->fnc", x, w) + b[:, None, :], axis=-1)


def fits_per_call(n: int, num_classes: int) -> int:
  """How many fits to solve together (every call is padded to this many: one compiled shape per
  task). XLA:CPU slows down sharply once the per-step `[fits, N, C]` activations outgrow the
  caches, so CPU batches are kept to ~1M entries; accelerators take 64x more."""
  scale = 1 if jax.default_backend() == "cpu" else 64
  budget = scale * FIT_BATCH_ENTRIES // max(1, n * num_classes)
  return int(max(1, min(scale * MAX_FITS_PER_CALL, budget)))


def fit_predict(x: np.ndarray, y: np.ndarray, train_sets: Sequence[np.ndarray],
                l2s: Sequence[float], num_classes: int) -> np.ndarray:
  """Trains one model per (train index set, l2) and predicts every row: int `[F, N]`."""
  weights = np.zeros((len(train_sets), len(y)), np.float32)
  for row, idx in enumerate(train_sets):
    weights[row, idx] = 1.0
  l2s = np.asarray(l2s, np.float32)
  x, labels = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32)
  chunk = fits_per_call(len(y), num_classes)
  predictions = []
  for start in range(0, len(weights), chunk):
    rows = np.arange(start, min(start + chunk, len(weights)))
    rows = np.concatenate([rows, np.full(chunk - len(rows), rows[0])])  # pad: one compiled shape
    w, b = fit_logreg(x, labels, weights[rows], l2s[rows], num_classes=num_classes)
    predictions.append(np.asarray(predict_logreg(x, w, b))[:min(chunk, len(weights) - start)])
  return np.concatenate(predictions)


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
