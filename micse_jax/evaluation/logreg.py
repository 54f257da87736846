"""Batched multinomial logistic regression for the SentEval transfer probes (`transfer.py`).

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
about 1M `fits * N * classes` entries; beyond that XLA:CPU slows down sharply), faster than
sequential scikit-learn lbfgs fits on CPU and unchanged on GPU/TPU. The solver is a small L-BFGS
written here rather than `optax.lbfgs`: under `vmap` the zoom line search's branches all execute,
so each step costs many objective evaluations (measured: docs/transfer-protocol.md, "The
`logreg` protocol's solver"). scikit-learn's `LogisticRegression` (same objective with
`C = 1 / (n * l2)`) is the independent check in the tests.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_ITER = 150
TOL = 1e-4
FIT_BATCH_ENTRIES = 1 << 20
MAX_FITS_PER_CALL = 64

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
