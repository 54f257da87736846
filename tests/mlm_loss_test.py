"""Tests for micse_jax.losses.mlm against a NumPy log-softmax cross-entropy."""
import jax
import jax.numpy as jnp
import numpy as np

from micse_jax.losses.mlm import mlm_loss


def _np_loss(logits, labels, weights):
  logits = np.asarray(logits, np.float64)
  shift = logits - logits.max(-1, keepdims=True)
  logp = shift - np.log(np.exp(shift).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, np.asarray(labels)[..., None], -1)[..., 0]
  return float((nll * weights).sum() / weights.sum())


def test_matches_numpy_and_ignores_unweighted_positions():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 7, 50)).astype(np.float32) * 3
  labels = rng.integers(0, 50, (3, 7))
  weights = (rng.random((3, 7)) < 0.4).astype(np.float32)
  weights[0, 0] = 1.0
  got = float(mlm_loss(logits, labels, weights))
  np.testing.assert_allclose(got, _np_loss(logits, labels, weights), rtol=1e-5)
  # Garbage at unweighted positions changes nothing (value or gradient).
  logits2 = np.where(weights[..., None] > 0, logits, np.nan).astype(np.float32)
  np.testing.assert_allclose(float(mlm_loss(logits2, labels, weights)), got, rtol=1e-6)
  grad = jax.grad(mlm_loss)(jnp.asarray(logits2), labels, weights)
  assert np.all(np.isfinite(np.asarray(grad)))


def test_bf16_logits_computed_in_float32_and_empty_selection():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 5, 30)).astype(np.float32)
  labels = rng.integers(0, 30, (2, 5))
  weights = np.ones((2, 5), np.float32)
  out = mlm_loss(jnp.asarray(logits, jnp.bfloat16), labels, weights)
  assert out.dtype == jnp.float32
  ref = _np_loss(np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32)), labels, weights)
  np.testing.assert_allclose(float(out), ref, rtol=1e-5)
  assert float(mlm_loss(logits, labels, np.zeros((2, 5), np.float32))) == 0.0
