"""Tests for losses.alignment (Wang & Isola, positive-only) and losses.reconstruction
(InforMin-CL) against NumPy and PyTorch computations."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from micse_jax.losses import alignment as al
from micse_jax.losses.reconstruction import reconstruction_loss


def _emb(seed, n=9, d=16):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n, d)).astype(np.float32)


def _unit(x):
  x = np.asarray(x, np.float64)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_alignment_and_uniformity_match_numpy_loops():
  z1, z2 = _emb(0)
  u1, u2 = _unit(z1), _unit(z2)
  for alpha in (1.0, 2.0, 3.0):
    want = np.mean([np.linalg.norm(a - b) ** alpha for a, b in zip(u1, u2)])
    np.testing.assert_allclose(float(al.alignment(z1, z2, alpha)), want, rtol=1e-5)
  for t in (1.0, 2.0):
    terms = [np.exp(-t * np.sum((u1[i] - u1[j]) ** 2))
             for i in range(len(u1)) for j in range(i + 1, len(u1))]
    np.testing.assert_allclose(float(al.uniformity(z1, t)), np.log(np.mean(terms)), rtol=1e-5)
  # Identical views align perfectly; collapsed embeddings are maximally non-uniform (0).
  assert float(al.alignment(z1, z1)) == pytest.approx(0.0, abs=1e-6)
  assert float(al.uniformity(np.ones((5, 4), np.float32))) == pytest.approx(0.0, abs=1e-6)
  with pytest.raises(ValueError):
    al.uniformity(z1[:1])


def test_positive_only_diag_only_matches_torch_official_recipe():
  """The official `--diag_only`: zero the off-diagonal cosine logits, then cross-entropy."""
  z1, z2 = _emb(1)
  tau = 0.05
  cos = F.cosine_similarity(torch.tensor(z1).unsqueeze(1), torch.tensor(z2).unsqueeze(0), dim=-1) / tau
  cos = cos - torch.triu(cos, diagonal=1) - torch.tril(cos, diagonal=-1)
  want = F.cross_entropy(cos, torch.arange(len(z1))).item()
  np.testing.assert_allclose(float(al.positive_only_loss(z1, z2, tau)), want, rtol=1e-5)
  # No negatives: the loss does not change when other sentences move.
  z2b = z2.copy()
  z2b[1:] = -z2b[1:]
  grad = jax.grad(lambda a: al.positive_only_loss(a, z2, tau))(jnp.asarray(z1))
  grad_b = jax.grad(lambda a: al.positive_only_loss(a, z2b, tau))(jnp.asarray(z1))
  np.testing.assert_allclose(np.asarray(grad[0]), np.asarray(grad_b[0]), rtol=1e-5, atol=1e-7)


def test_positive_only_alignment_form():
  z1, z2 = _emb(2)
  want = -np.mean(np.sum(_unit(z1) * _unit(z2), -1)) / 0.1
  np.testing.assert_allclose(float(al.positive_only_loss(z1, z2, 0.1, form='alignment')), want,
                             rtol=1e-5)
  assert float(al.positive_only_loss(z1[:1], z2[:1], 0.1)) == 0.0
  with pytest.raises(ValueError, match='form'):
    al.positive_only_loss(z1, z2, 0.1, form='negatives')


def test_reconstruction_paper_and_public_forms():
  z1, z2 = _emb(3, d=12)
  paper = np.mean(np.sum((z1.astype(np.float64) - z2) ** 2, -1))
  np.testing.assert_allclose(float(reconstruction_loss(z1, z2)), paper, rtol=1e-5)
  u1, u2 = _unit(z1), _unit(z2)
  np.testing.assert_allclose(float(reconstruction_loss(z1, z2, normalize=True)),
                             np.mean(np.sum((u1 - u2) ** 2, -1)), rtol=1e-5)
  # Public code: mse(a, b) + mse(b, a) on L2-normalised vectors.
  t1 = F.normalize(torch.tensor(z1), dim=-1)
  t2 = F.normalize(torch.tensor(z2), dim=-1)
  public = (F.mse_loss(t1, t2) + F.mse_loss(t2, t1)).item()
  np.testing.assert_allclose(
      float(reconstruction_loss(z1, z2, normalize=True, public_scale=True)), public, rtol=1e-5)
  # The factor between the normalised forms is 2 / D.
  np.testing.assert_allclose(public, 2 / 12 * np.mean(np.sum((u1 - u2) ** 2, -1)), rtol=1e-5)
  assert reconstruction_loss(jnp.asarray(z1, jnp.bfloat16), z2).dtype == jnp.float32
