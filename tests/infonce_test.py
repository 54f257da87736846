"""Tests for micse_jax.losses.infonce against an independent NumPy implementation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from micse_jax.losses.infonce import info_nce_loss as _info_nce_loss

# Jitted: eager op-by-op dispatch would dominate the test time.
info_nce_loss = jax.jit(_info_nce_loss)


def _np_normalize(x):
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _np_logsumexp(a):
  top = a.max(axis=1, keepdims=True)
  return (top + np.log(np.exp(a - top).sum(axis=1, keepdims=True)))[:, 0]


def _np_infonce(z1, z2, queue=None, valid=None, tau=0.05):
  """Row-wise cross-entropy with label i; invalid queue rows are simply dropped."""
  z1 = _np_normalize(np.asarray(z1, np.float64))
  z2 = _np_normalize(np.asarray(z2, np.float64))
  logits = z1 @ z2.T / tau
  if queue is not None:
    q = np.asarray(queue, np.float64)
    if valid is not None:
      q = q[np.asarray(valid, bool)]
    if len(q):
      logits = np.concatenate([logits, z1 @ _np_normalize(q).T / tau], axis=1)
  pos = np.diag(logits)
  loss = np.mean(_np_logsumexp(logits) - pos)
  acc = np.mean(np.argmax(logits, axis=1) == np.arange(len(z1)))
  return loss, np.mean(np.diag(z1 @ z2.T)), acc


def _views(seed, batch=6, dim=8, noise=0.3):
  rng = np.random.default_rng(seed)
  z1 = rng.normal(size=(batch, dim)).astype(np.float32)
  z2 = (z1 + noise * rng.normal(size=(batch, dim))).astype(np.float32)
  return z1, z2, rng


@pytest.mark.parametrize('tau', [0.05, 1.0])
def test_matches_numpy_without_queue(tau):
  z1, z2, _ = _views(0)
  loss, metrics = info_nce_loss(jnp.asarray(z1), jnp.asarray(z2), temperature=tau)
  ref, pos_cos, acc = _np_infonce(z1, z2, tau=tau)
  np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(metrics['infonce'], ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(metrics['pos_cos'], pos_cos, rtol=1e-5)
  np.testing.assert_allclose(metrics['acc'], acc)


def test_matches_numpy_with_full_queue():
  z1, z2, rng = _views(1)
  queue = _np_normalize(rng.normal(size=(10, 8))).astype(np.float32)
  loss, metrics = info_nce_loss(z1, z2, queue=queue)
  ref, _, acc = _np_infonce(z1, z2, queue)
  np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(metrics['acc'], acc)
  # An explicit all-True mask is the same as no mask.
  loss_masked, _ = info_nce_loss(z1, z2, queue=queue, queue_valid=np.ones(10, bool))
  np.testing.assert_allclose(loss_masked, loss, rtol=1e-6)


def test_queue_negatives_increase_loss():
  z1, z2, rng = _views(2)
  queue = rng.normal(size=(32, 8)).astype(np.float32)
  plain, _ = info_nce_loss(z1, z2)
  with_queue, _ = info_nce_loss(z1, z2, queue=queue)
  assert with_queue > plain


@pytest.mark.parametrize('garbage', [1e6, np.nan, np.inf])
def test_partially_valid_queue_ignores_invalid_slots(garbage):
  z1, z2, rng = _views(3)
  queue = rng.normal(size=(12, 8)).astype(np.float32)
  valid = np.zeros(12, bool)
  valid[[0, 3, 4, 9]] = True
  ref, _, acc = _np_infonce(z1, z2, queue, valid)
  dirty = queue.copy()
  dirty[~valid] = garbage
  # Garbage that would win the argmax if it were not masked.
  dirty[1] = 1e3 * z1[0] if np.isfinite(garbage) else garbage

  loss, metrics = info_nce_loss(z1, z2, queue=dirty, queue_valid=valid)
  np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(metrics['acc'], acc)
  grads = _masked_queue_grad(z1, z2, dirty, valid)
  for g in grads:
    assert np.all(np.isfinite(g))
  np.testing.assert_array_equal(grads[2][~valid], 0.0)
  clean_grads = _masked_queue_grad(z1, z2, queue, valid)
  np.testing.assert_allclose(grads[0], clean_grads[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grads[1], clean_grads[1], rtol=1e-5, atol=1e-6)


@jax.jit
def _masked_queue_grad(z1, z2, queue, valid):
  loss_fn = lambda a, b, q: _info_nce_loss(a, b, queue=q, queue_valid=valid)[0]
  return jax.grad(loss_fn, argnums=(0, 1, 2))(z1, z2, queue)


def test_empty_valid_queue_equals_no_queue():
  z1, z2, rng = _views(4)
  queue = rng.normal(size=(5, 8)).astype(np.float32)
  loss, _ = info_nce_loss(z1, z2, queue=queue, queue_valid=np.zeros(5, bool))
  plain, _ = info_nce_loss(z1, z2)
  np.testing.assert_allclose(loss, plain, rtol=1e-5, atol=1e-6)


def test_bf16_inputs_computed_in_float32():
  z1, z2, _ = _views(5)
  z1b, z2b = jnp.asarray(z1, jnp.bfloat16), jnp.asarray(z2, jnp.bfloat16)
  loss, _ = info_nce_loss(z1b, z2b)
  assert loss.dtype == jnp.float32
  ref, _, _ = _np_infonce(np.asarray(z1b, np.float32), np.asarray(z2b, np.float32))
  np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-5)


def test_identical_views_perfect_accuracy():
  z1, _, _ = _views(6, batch=4, dim=32)
  _, metrics = info_nce_loss(z1, z1)
  np.testing.assert_allclose(metrics['pos_cos'], 1.0, rtol=1e-6)
  np.testing.assert_allclose(metrics['acc'], 1.0)


def test_gradients_match_finite_differences():
  z1, z2, rng = _views(7, batch=4, dim=5)
  queue = rng.normal(size=(6, 5))
  valid = jnp.asarray([True, False, True, True, False, True])
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(a, jnp.float64) for a in (z1, z2, queue))

    @jax.jit
    def loss_fn(a, b, q):
      return _info_nce_loss(a, b, queue=q, queue_valid=valid, temperature=0.5)[0]

    check_grads(loss_fn, args, order=1, modes=('rev',), atol=1e-5, rtol=1e-5)
