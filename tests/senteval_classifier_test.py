"""SentEval's transfer classifier in JAX (`senteval` protocol) against independent computations:
NumPy Adam / RMSprop steps written from PyTorch's update rules, SentEval's early-stopping rule on a
hand case, its NumPy-drawn hold-out and pass orders, a NumPy re-run of a whole fit, sklearn folds."""
import dataclasses

import jax
import numpy as np
import pytest
from sklearn.model_selection import StratifiedKFold

from micse_jax.evaluation import senteval_classifier as sc
from micse_jax.evaluation import transfer


def _numpy_adam(p, g, m, v, t, l2, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
  """torch.optim.Adam(weight_decay=l2) for step t (1-based): returns (p, m, v)."""
  g = g + l2 * p
  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * g * g
  denom = np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps
  return p - lr / (1 - b1 ** t) * m / denom, m, v


def _numpy_rmsprop(p, g, s, l2, lr=1e-2, alpha=0.99, eps=1e-8):
  """torch.optim.RMSprop(weight_decay=l2): returns (p, s)."""
  g = g + l2 * p
  s = alpha * s + (1 - alpha) * g * g
  return p - lr * g / (np.sqrt(s) + eps), s


@pytest.mark.parametrize("name", ["adam", "rmsprop"])
def test_decayed_optimizer_is_torch_update_with_decay_on_bias(name):
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2)}
  l2 = 0.3  # large, so that missing decay on the bias would show
  opt = sc.decayed_optimizer(name, l2)
  state = opt.init(jax.tree.map(np.float32, params))
  ours = jax.tree.map(np.float32, params)
  ref = {k: (v.copy(), np.zeros_like(v), np.zeros_like(v)) for k, v in params.items()}
  for t in range(1, 4):
    grads = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2)}
    updates, state = opt.update(jax.tree.map(np.float32, grads), state, ours)
    ours = jax.tree.map(lambda p, u: p + u, ours, updates)
    for k, (p, m, v) in list(ref.items()):
      if name == "adam":
        ref[k] = _numpy_adam(p, grads[k], m, v, t, l2)
      else:
        p, v = _numpy_rmsprop(p, grads[k], v, l2)
        ref[k] = (p, m, v)
  for k in ref:
    np.testing.assert_allclose(np.asarray(ours[k]), ref[k][0], rtol=1e-5, atol=1e-6)


def test_early_stopping_counter_is_never_reset():
  """SentEval: a round that does not improve stops once the (never reset) counter has reached
  `tenacity`; with tenacity 2 the 3rd non-improving round stops, even with improvements between."""
  accuracies = [0.5, 0.4, 0.6, 0.4, 0.7, 0.4, 0.9, 0.95]
  best, count, stopped_after = -1.0, 0, None
  for round_, acc in enumerate(accuracies, 1):
    improved = acc > best
    best = max(best, acc)
    stop, count = sc.should_stop(improved, count, tenacity=2)
    if stop:
      stopped_after = round_
      break
  assert stopped_after == 6 and best == 0.7


def test_holdout_and_pass_orders_are_sentevals_numpy_draws():
  n, seed = 101, 1111
  np.random.seed(seed)  # SentEval: MLP.__init__, then prepare_split, then one draw per pass
  permutation = np.random.permutation(n)
  cut = int(0.05 * n)
  expected_dev, expected_train = permutation[:cut], permutation[cut:]
  passes = [np.random.permutation(n - cut) for _ in range(3)]
  rows_of = np.arange(1000, 1000 + n)  # the fit's training rows, as global row ids
  orders = sc._Orders([sc.FitSpec(rows_of, None, 1e-3)], seed)
  np.testing.assert_array_equal(orders.devs[0], rows_of[expected_dev])
  rows = orders.next_round(2, batch_size=16, fits=np.array([0]))
  rows = np.concatenate([rows[0], orders.next_round(1, batch_size=16, fits=np.array([0]))[0]])
  for p in range(3):
    np.testing.assert_array_equal(rows[p, :n - cut], rows_of[expected_train][passes[p]])
    assert (rows[p, n - cut:] == -1).all() and rows.shape[1] % 16 == 0


def _numpy_fit(x, y, train, dev, l2, settings, seed, params):
  """SentEval's MLP.fit (nhid=0, Adam) re-written in NumPy from its source; returns best params."""
  stream = np.random.RandomState(seed)
  w, b = params["w"].astype(np.float64), params["b"].astype(np.float64)
  mw, vw, mb, vb = (np.zeros_like(w), np.zeros_like(w), np.zeros_like(b), np.zeros_like(b))
  best, best_params, count, epoch, t = -1.0, (w, b), 0, 0, 0
  while epoch <= settings.max_epoch:
    for _ in range(settings.epoch_size):
      order = train[stream.permutation(len(train))]
      for i in range(0, len(order), settings.batch_size):
        idx = order[i:i + settings.batch_size]
        z = x[idx] @ w + b
        prob = np.exp(z - z.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        prob[np.arange(len(idx)), y[idx]] -= 1.0
        t += 1
        w, mw, vw = _numpy_adam(w, x[idx].T @ prob / len(idx), mw, vw, t, l2)
        b, mb, vb = _numpy_adam(b, prob.mean(0), mb, vb, t, l2)
    epoch += settings.epoch_size
    accuracy = np.mean(np.argmax(x[dev] @ w + b, 1) == y[dev])
    if accuracy > best:
      best, best_params = accuracy, (w, b)
    else:
      if count >= settings.tenacity:
        break
      count += 1
  return best_params


def test_train_predict_equals_numpy_rerun_of_sentevals_fit():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(90, 5)).astype(np.float32)
  y = (x[:, 0] + 0.8 * rng.normal(size=90) > 0).astype(np.int32)  # noisy: early stopping acts
  settings = dataclasses.replace(sc.TEST, batch_size=16, epoch_size=2, tenacity=2, max_epoch=60)
  train, dev = np.arange(0, 60), np.arange(60, 90)
  specs = [sc.FitSpec(train, dev, 1e-2), sc.FitSpec(train[::2], dev, 1e-4)]
  ours = sc.train_predict(x, y, specs, 2, settings=settings, seed=7)
  init = jax.tree.map(np.asarray, sc.init_params(jax.random.PRNGKey(7), 5, 2))
  for spec, predictions in zip(specs, ours):
    w, b = _numpy_fit(x.astype(np.float64), y, spec.train, spec.dev, spec.l2, settings, 7, init)
    expected = np.argmax(x @ w + b, 1)
    assert np.mean(predictions == expected) >= 0.98  # float32 vs float64 near the boundary


def test_separable_problem_is_learned():
  rng = np.random.default_rng(1)
  y = rng.integers(0, 3, 300)
  x = (np.eye(3)[y] * 4 + rng.normal(size=(300, 3)) * 0.3).astype(np.float32)
  classifier = transfer.senteval_classifier_for(fast=True, seed=1111)
  result = transfer.kfold_eval(x[:200], y[:200], x[200:], y[200:], 3, k=5,
                               classifier=classifier)
  assert result["acc"] == 100.0 and result["devacc"] == 100.0


def test_inner_kfold_folds_are_sklearns_with_seed_1111_whatever_the_seed():
  """The senteval protocol's MR/CR/SUBJ/MPQA folds are SentEval's: outer and inner
  StratifiedKFold(shuffle=True, random_state=1111), the inner ones the early-stopping sets."""
  rng = np.random.default_rng(0)
  y = rng.integers(0, 2, 80)
  x = rng.normal(size=(80, 3)).astype(np.float32)
  seen = []

  def recording(x_, y_, specs, num_classes):
    seen.append(specs)
    return np.zeros((len(specs), len(y_)), np.int64)

  transfer.inner_kfold_eval(x, y, 2, 5, 5, grid=(1e-3,), seed=transfer.INNER_KFOLD_SEED,
                            classifier=recording)
  skf = StratifiedKFold(n_splits=5, shuffle=True, random_state=1111)
  outer = list(skf.split(x, y))
  expected_dev = [tr[b] for tr, _ in outer for _, b in skf.split(x[tr], y[tr])]
  assert [s.dev.tolist() for s in seen[0]] == [d.tolist() for d in expected_dev]
  assert [s.train.tolist() for s in seen[1]] == [tr.tolist() for tr, _ in outer]
  assert all(s.dev is None for s in seen[1])  # final fits: SentEval's random 5 % hold-out
  run = transfer._run_settings("senteval", fast=False, seed=5)
  assert run["inner_kfold_seed"] == 1111 and run["seed"] == 5


def test_protocol_settings_name_the_protocol():
  assert transfer.protocol_settings("senteval", fast=True)["classifier"]["optimizer"] == "rmsprop"
  assert transfer.protocol_settings("senteval", fast=False)["folds"] == {
      "outer": 10, "inner": 10, "kfold": 10}
  assert transfer.protocol_settings("logreg", fast=True)["protocol"] == "logreg"
  with pytest.raises(ValueError, match="unknown transfer protocol"):
    transfer.protocol_settings("sklearn", fast=False)
