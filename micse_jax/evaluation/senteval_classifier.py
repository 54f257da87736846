"""SentEval's transfer classifier (`senteval/tools/classifier.py`, `nhid=0`) in JAX with optax.

The model is a linear layer `logits = x W + b` on the raw features, trained on the mean
cross-entropy of each minibatch (eq. 1: `L = -1/|B| sum_{i in B} log softmax(x_i W + b)_{y_i}`)
with the L2 value applied as coupled weight decay on every parameter, bias included
(eq. 2: `g <- grad L + l2 * theta`, PyTorch's `weight_decay`, then the optimiser step):

* `test` (SimCSE `--mode test`): Adam (lr 1e-3, betas 0.9/0.999, eps 1e-8), batch 64,
  epoch size 4, tenacity 5, 10 folds;
* `fasttest` (`--mode fasttest`): RMSprop (lr 1e-2, alpha 0.99, eps 1e-8 outside the root),
  batch 128, epoch size 2, tenacity 3, 5 folds.

Training (SentEval's `fit`): every round runs `epoch_size` passes over the training rows, each in
a fresh random order cut into batches (the last one smaller), then scores the dev rows; a better
accuracy keeps the model, otherwise a counter (never reset) grows, and the round after the
counter has reached `tenacity` stops; at most `max_epoch` (200) passes. The best dev model is
the result. Dev rows are a given set (inner folds, SST2's dev) or SentEval's `validation_split`
of 5 %: `permutation(n)[:int(0.05 n)]`.

Randomness: like SentEval, every fit starts from the same seed. The pass orders and the 5 %
hold-out are drawn exactly as SentEval draws them (`np.random.seed(seed)` then successive
`np.random.permutation` calls: a `RandomState(seed)` stream per fit), so they are SentEval's own
orders; only the initial weights (PyTorch's `nn.Linear` draw, `U(-1/sqrt(D), 1/sqrt(D))`) come
from a JAX key instead, which is why agreement with SentEval is statistical, not bitwise.

Vectorisation: the fits of one stage (folds x L2 values) are stacked on a leading axis and
trained in lock step under one `jit` (one `[F, B, D] x [F, D, C]` product per step); a fit that
has stopped is frozen by masking. Host NumPy keeps the early-stopping bookkeeping.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

VALIDATION_SPLIT = 0.05
FIT_ROWS_PER_CALL = 1 << 21  # fits * padded train rows per compiled call (CPU cache budget)


@dataclasses.dataclass(frozen=True)
class ClassifierSettings:
  """SentEval's `params.classifier` (`nhid=0`) and `kfold` for one SimCSE mode."""
  optimizer: str
  batch_size: int
  tenacity: int
  epoch_size: int
  kfold: int
  max_epoch: int = 200


TEST = ClassifierSettings("adam", 64, 5, 4, 10)
FASTTEST = ClassifierSettings("rmsprop", 128, 3, 2, 5)


def torch_default_optimizer(name: str) -> optax.GradientTransformation:
  """PyTorch's `optim.Adam()` / `optim.RMSprop()` with their default hyper-parameters."""
  if name == "adam":
    return optax.adam(1e-3, b1=0.9, b2=0.999, eps=1e-8)
  if name == "rmsprop":
    return optax.rmsprop(1e-2, decay=0.99, eps=1e-8, eps_in_sqrt=False)
  raise ValueError(f"unknown optimizer {name!r}; expected adam or rmsprop")


def decayed_optimizer(name: str, l2) -> optax.GradientTransformation:
  """Eq. 2: coupled weight decay `g + l2 * theta` (bias too), then the torch-default optimiser."""
  return optax.chain(optax.add_decayed_weights(l2), torch_default_optimizer(name))


# ---------------------------------------------------------------- host side: SentEval's draws

def holdout_split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.random.RandomState]:
  """SentEval's `validation_split=0.05`: (train positions, dev positions, the stream after)."""
  stream = np.random.RandomState(seed)
  permutation = stream.permutation(n)
  cut = int(VALIDATION_SPLIT * n)
  return permutation[cut:], permutation[:cut], stream


def should_stop(improved: bool, count: int, tenacity: int) -> tuple[bool, int]:
  """SentEval's early-stopping rule after one round: returns (stop, new count)."""
  if improved:
    return False, count
  return count >= tenacity, count + 1


@dataclasses.dataclass
class FitSpec:
  """One fit: training rows, dev rows (None: SentEval's random 5 % of the training rows), L2."""
  train: np.ndarray
  dev: np.ndarray | None
  l2: float


class _Orders:
  """Per-fit pass orders drawn like SentEval's (one `RandomState(seed)` stream per fit)."""

  def __init__(self, specs: Sequence[FitSpec], seed: int):
    self.trains, self.devs, self.streams = [], [], []
    for spec in specs:
      if spec.dev is None:
        keep, held, stream = holdout_split(len(spec.train), seed)
        self.trains.append(spec.train[keep])
        self.devs.append(spec.train[held])
      else:
        stream = np.random.RandomState(seed)
        self.trains.append(spec.train)
        self.devs.append(spec.dev)
      self.streams.append(stream)
    self.width = max(len(t) for t in self.trains)

  def next_round(self, passes: int, batch_size: int, fits: np.ndarray) -> np.ndarray:
    """Row ids `[len(fits), passes, padded width]` (-1 = padding) of the next `passes` passes of
    `fits` (a stopped fit draws no more: its stream is never used again)."""
    width = -(-self.width // batch_size) * batch_size
    rows = np.full((len(fits), passes, width), -1, np.int32)
    for row, f in enumerate(fits):
      train, stream = self.trains[f], self.streams[f]
      for p in range(passes):
        rows[row, p, :len(train)] = train[stream.permutation(len(train))]
    return rows

  def dev_mask(self, n: int) -> np.ndarray:
    """`[F, N]` 1.0 on each fit's dev rows."""
    mask = np.zeros((len(self.devs), n), np.float32)
    for f, dev in enumerate(self.devs):
      mask[f, dev] = 1.0
    return mask


# ---------------------------------------------------------------- device side

def init_params(key, dim: int, num_classes: int):
  """`nn.Linear(dim, C)`'s initial distribution: W, b ~ U(-1/sqrt(dim), 1/sqrt(dim))."""
  bound = 1.0 / np.sqrt(dim)
  k_w, k_b = jax.random.split(key)
  return {"w": jax.random.uniform(k_w, (dim, num_classes), jnp.float32, -bound, bound),
          "b": jax.random.uniform(k_b, (num_classes,), jnp.float32, -bound, bound)}


def batch_loss(params, xb, yb, valid):
  """Eq. 1: mean cross-entropy over the valid rows of one minibatch."""
  logits = xb @ params["w"] + params["b"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
  return jnp.sum(nll * valid) / jnp.maximum(jnp.sum(valid), 1.0)


def _one_step(optimizer, params, opt_state, xb, yb, valid, l2, active):
  grads = jax.grad(batch_loss)(params, xb, yb, valid)
  updates, new_state = decayed_optimizer(optimizer, l2).update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jnp.where(active, new, old)
  return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, opt_state)


@functools.partial(jax.jit, static_argnames=("optimizer", "batch_size"), donate_argnums=(2, 3))
def train_round(x, y, params, opt_state, rows, l2, running, *, optimizer: str, batch_size: int):
  """`passes` passes of minibatch steps for `F` fits in lock step.

  Args: x `[N, D]`, y `[N]`, params/opt_state with a leading `[F]` axis, rows `[F, P, W]` row ids
  (-1 = padding, W a multiple of `batch_size`), l2 `[F]`, running `[F]` (False: frozen).
  """
  f, passes, width = rows.shape
  batches = rows.reshape(f, passes * width // batch_size, batch_size).transpose(1, 0, 2)
  step = jax.vmap(functools.partial(_one_step, optimizer))

  def body(carry, idx):
    params, opt_state = carry
    valid = (idx >= 0).astype(jnp.float32)
    safe = jnp.maximum(idx, 0)
    active = running & (valid[:, 0] > 0)  # a batch of padding only is no step
    return step(params, opt_state, x[safe], y[safe], valid, l2, active), None

  (params, opt_state), _ = jax.lax.scan(body, (params, opt_state), batches)
  return params, opt_state


@jax.jit
def predict(x, params):
  """Class predictions `[F, N]` of `F` stacked linear models."""
  return jnp.argmax(jnp.einsum("nd,fdc->fnc", x, params["w"]) + params["b"][:, None], -1)


def _take(tree, index: np.ndarray):
  """Rows `index` of every leaf (leading fit axis)."""
  return jax.tree.map(lambda a: a[index], tree)


def _put(tree, index: np.ndarray, rows):
  """`tree` with rows `index` of every leaf replaced by `rows`."""
  return jax.tree.map(lambda a, r: a.at[index].set(r), tree, rows)


def _bucket(n: int) -> int:
  """Compiled fit-axis size for `n` live fits: the next power of two (few compiled shapes)."""
  return 1 << max(0, int(n - 1).bit_length())


def _train_group(x, y, specs: Sequence[FitSpec], settings: ClassifierSettings, seed: int,
                 num_classes: int) -> np.ndarray:
  """SentEval's `fit` for a group of fits in lock step; predictions `[F, N]` of the best models.

  Stopped fits leave the compiled batch once at most half of it is still training (the batch
  shrinks to the next power of two; its padding repeats a live fit, frozen).
  """
  orders = _Orders(specs, seed)
  dev_mask = orders.dev_mask(len(y))
  l2_all = np.asarray([s.l2 for s in specs], np.float32)
  init = init_params(jax.random.PRNGKey(seed), x.shape[1], num_classes)
  best = jax.tree.map(lambda a: jnp.broadcast_to(a, (len(specs),) + a.shape) + 0, init)
  best_acc = np.full(len(specs), -1.0)
  count = np.zeros(len(specs), np.int64)
  stopped = np.zeros(len(specs), bool)
  slots = np.arange(_bucket(len(specs))) % len(specs)  # fit of each compiled slot
  params = jax.tree.map(lambda a: a[slots], best)
  opt_state = jax.vmap(lambda p, r: decayed_optimizer(settings.optimizer, r).init(p))(
      params, jnp.asarray(l2_all[slots]))
  labels, epoch = np.asarray(y), 0
  while not stopped.all() and epoch <= settings.max_epoch:
    live = np.flatnonzero(~stopped)
    if len(live) <= len(slots) // 2:  # compact: keep the live fits' slots only
      keep = np.asarray([np.flatnonzero(slots == f)[0] for f in live])
      keep = keep[np.arange(_bucket(len(live))) % len(live)]
      slots = slots[keep]
      params, opt_state = _take((params, opt_state), keep)
    running = np.zeros(len(slots), bool)
    first = {f: i for i, f in reversed(list(enumerate(slots)))}
    running[[first[f] for f in live]] = True
    drawn = orders.next_round(settings.epoch_size, settings.batch_size, live)
    rows = np.full((len(slots),) + drawn.shape[1:], -1, np.int32)
    rows[running] = drawn[np.searchsorted(live, slots[running])]
    params, opt_state = train_round(x, y, params, opt_state, rows, jnp.asarray(l2_all[slots]),
                                    jnp.asarray(running), optimizer=settings.optimizer,
                                    batch_size=settings.batch_size)
    epoch += settings.epoch_size
    correct = np.asarray(predict(x, params)) == labels[None]
    accuracy = (correct * dev_mask[slots]).sum(1) / dev_mask[slots].sum(1)
    improved_slots = np.flatnonzero(running & (accuracy > best_acc[slots]))
    improved = slots[improved_slots]
    best_acc[improved] = accuracy[improved_slots]
    best = _put(best, improved, _take(params, improved_slots))
    for f in np.setdiff1d(live, improved):
      stopped[f], count[f] = should_stop(False, int(count[f]), settings.tenacity)
  return np.asarray(predict(x, best))


def train_predict(x: np.ndarray, y: np.ndarray, specs: Sequence[FitSpec], num_classes: int, *,
                  settings: ClassifierSettings, seed: int) -> np.ndarray:
  """Trains one SentEval classifier per `FitSpec` and predicts every row: int `[F, N]`.

  Fits are grouped so that `fits x padded train rows` stays near `FIT_ROWS_PER_CALL` (memory
  traffic per step on CPU); each group runs until its last fit stops.
  """
  x, labels = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32)
  width = max(len(s.train) for s in specs)
  scale = 1 if jax.default_backend() == "cpu" else 16
  group = int(max(1, scale * FIT_ROWS_PER_CALL // max(1, width)))
  out = [_train_group(x, labels, specs[i:i + group], settings, seed, num_classes)
         for i in range(0, len(specs), group)]
  return np.concatenate(out)
