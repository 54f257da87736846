"""The official-code AMI variant (`official_ami_loss`) against an independent
NumPy transcription of the recipe in SAP-samples/acl2023-micse (`model/models.py`), and a
check that the paper variant is unchanged."""

import jax
import jax.numpy as jnp
import numpy as np

from micse_jax.losses import ami, ami_official

LAMBDA = 2.5e-3
_loss = jax.jit(ami.ami_loss, static_argnames=('num_samples', 'heads_per_slice',
                                                'pool_layers', 'require_positive', 'min_valid'))
_official_loss = jax.jit(ami_official.official_ami_loss, static_argnames=('num_samples',))
_paper_ami = jax.jit(ami.attention_mutual_information,
                     static_argnames=('num_samples', 'heads_per_slice', 'pool_layers', 'min_valid'))
_official = jax.jit(ami_official.official_attention_mutual_information, static_argnames=('num_samples',))


def _attention(rng, num_layers, lengths, heads, length):
  """Softmax over real keys (padding keys exactly 0); padding query rows attend to real keys."""
  mask = (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  scores = rng.normal(size=(num_layers, len(lengths), heads, length, length))
  scores = np.where(mask[None, :, None, None, :] > 0, scores, -np.inf)
  att = np.exp(scores - scores.max(-1, keepdims=True))
  return (att / att.sum(-1, keepdims=True)).astype(np.float32), mask


def _official_rows(att1, att2):
  """The official layout: views interleaved in the batch, then
  rearrange "(h i) (j m) k t z -> (h k m) i (j t z)" with i = m = 2. Returns (X, Y) `[R, C]`."""
  num_layers, batch, heads, t, _ = att1.shape
  both = np.stack([att1, att2], axis=0)  # [i, L, B, H, T, T]
  per_row = np.transpose(both, (2, 0, 1, 3, 4, 5))  # [B, i, L, H, T, T] = "(h i) (j m) k t z"
  a = per_row.reshape(batch, 2, num_layers // 2, 2, heads, t, t)  # h i j m k t z
  a = np.transpose(a, (0, 4, 3, 1, 2, 5, 6))  # h k m i j t z
  a = a.reshape(batch * heads * 2, 2, (num_layers // 2) * t * t)
  return a[:, 0].astype(np.float64), a[:, 1].astype(np.float64)


def _np_official_deterministic(att1, att2, num_samples):
  """Official recipe for the case where every kept row uses *all* its valid cells."""
  x, y = _official_rows(att1, att2)
  mask = (x > 0) & (y > 0)
  counts = mask.sum(1)
  rows = counts >= num_samples
  if rows.any():
    samples = num_samples
  else:
    samples = int(min(list(counts) + [num_samples]))
    rows = np.ones_like(rows)
  if samples == 0:
    return 0.0, None, None
  mis = []
  for r in np.flatnonzero(rows):
    assert counts[r] == samples, 'test case must use every valid cell of a kept row'
    u, v = np.log(x[r, mask[r]]), np.log(y[r, mask[r]])
    du, dv = u - u.mean(), v - v.mean()
    cos = du @ dv / max(np.linalg.norm(du) * np.linalg.norm(dv), 1e-6)
    mis.append(-0.5 * np.log(1.0 - cos ** 2))
  scale = (mask[rows].sum() / mask[rows].size) ** 2 + 1e-6
  return -np.mean(mis) * scale * LAMBDA, np.mean(mis), scale


def _ours_to_official_order(values, heads):
  """Our slice s = m * H + k; the official row within a sentence is k * 2 + m."""
  batch = values.shape[0]
  out = np.empty((batch, 2 * heads) + values.shape[2:], values.dtype)
  for m in range(2):
    for k in range(heads):
      out[:, k * 2 + m] = values[:, m * heads + k]
  return out.reshape((batch * 2 * heads,) + values.shape[2:])


def test_drops_slices_below_m_and_scales_by_valid_fraction():
  rng = np.random.default_rng(0)
  num_layers, heads, t = 4, 2, 5
  att1, _ = _attention(rng, num_layers, [t, t, t], heads, t)
  att2, _ = _attention(rng, num_layers, [t, t, t], heads, t)
  # Dropout zeros in a few (sentence, head, layer) blocks: those slices fall below m.
  att1[0, 0, 1, 2, 3] = 0.0  # layer 0 (parity 0), sentence 0, head 1
  att2[3, 2, 0, :, 1] = 0.0  # layer 3 (parity 1), sentence 2, head 0
  cells = (num_layers // 2) * t * t  # every slice is complete otherwise: m = C uses all cells
  want, want_mi, want_scale = _np_official_deterministic(att1, att2, cells)
  loss, metrics = _official_loss(att1, att2, jax.random.PRNGKey(0), weight=LAMBDA, num_samples=cells)
  np.testing.assert_allclose(float(loss), want, rtol=1e-4)
  np.testing.assert_allclose(float(metrics['ami_mi']), want_mi, rtol=1e-4)
  np.testing.assert_allclose(float(metrics['ami_scale']), want_scale, rtol=1e-6)
  res = _official(att1, att2, jax.random.PRNGKey(0), num_samples=cells)
  kept = _ours_to_official_order(np.asarray(res.weight), heads)
  x, y = _official_rows(att1, att2)
  np.testing.assert_array_equal(kept > 0, ((x > 0) & (y > 0)).sum(1) >= cells)
  assert kept.sum() == 3 * 2 * heads - 2


def test_fallback_lowers_m_and_counts_padding_rows():
  """No slice reaches m: all slices are kept with m = the smallest count; padding query rows
  (which attend to real keys) count as valid cells, padding keys (exact zeros) do not."""
  rng = np.random.default_rng(1)
  num_layers, heads, t, n = 2, 2, 6, 4
  att1, mask = _attention(rng, num_layers, [n, n], heads, t)
  att2, _ = _attention(rng, num_layers, [n, n], heads, t)
  res = _official(att1, att2, jax.random.PRNGKey(3), num_samples=150)
  np.testing.assert_array_equal(np.asarray(res.num_valid), np.full((2, 2 * heads), t * n))
  assert int(res.num_used) == t * n
  want, want_mi, want_scale = _np_official_deterministic(att1, att2, 150)
  loss, metrics = _official_loss(att1, att2, jax.random.PRNGKey(3), weight=LAMBDA, num_samples=150)
  np.testing.assert_allclose(float(loss), want, rtol=1e-4)
  np.testing.assert_allclose(float(metrics['ami_scale']), (n / t) ** 2 + 1e-6, rtol=1e-6)
  assert float(metrics['ami_pairs']) == 1.0


def test_random_sampling_matches_numpy_on_returned_cells():
  rng = np.random.default_rng(2)
  num_layers, heads, t, m = 4, 2, 8, 40
  lengths = [8, 5, 3, 2]
  att1, mask = _attention(rng, num_layers, lengths, heads, t)
  att2, _ = _attention(rng, num_layers, lengths, heads, t)
  att1 = np.where(rng.random(att1.shape) < 0.1, 0.0, att1 / 0.9).astype(np.float32)
  att2 = np.where(rng.random(att2.shape) < 0.1, 0.0, att2 / 0.9).astype(np.float32)
  res = _official(att1, att2, jax.random.PRNGKey(5), num_samples=m)
  x, y = _official_rows(att1, att2)
  valid = (x > 0) & (y > 0)
  counts = valid.sum(1)
  assert counts.min() < m <= counts.max()  # some slices dropped, some kept
  kept = _ours_to_official_order(np.asarray(res.weight), heads) > 0
  np.testing.assert_array_equal(kept, counts >= m)
  idx = _ours_to_official_order(np.asarray(res.indices), heads)
  sw = _ours_to_official_order(np.asarray(res.sample_weight), heads)
  mi = _ours_to_official_order(np.asarray(res.mi), heads)
  for r in np.flatnonzero(kept):
    cells = idx[r][sw[r] > 0]
    assert len(set(cells.tolist())) == m and valid[r, cells].all()
    u, v = np.log(x[r, cells]), np.log(y[r, cells])
    du, dv = u - u.mean(), v - v.mean()
    cos = du @ dv / (np.linalg.norm(du) * np.linalg.norm(dv))
    np.testing.assert_allclose(mi[r], -0.5 * np.log(1 - cos ** 2), rtol=2e-4, atol=1e-6)
  scale = (valid[kept].sum() / valid[kept].size) ** 2 + 1e-6
  np.testing.assert_allclose(float(res.scale), scale, rtol=1e-6)
  loss, _ = _official_loss(att1, att2, jax.random.PRNGKey(5), weight=LAMBDA, num_samples=m)
  np.testing.assert_allclose(float(loss), -LAMBDA * scale * mi[kept].mean(), rtol=1e-4)


def test_no_usable_cells_gives_zero_loss_and_finite_gradient():
  rng = np.random.default_rng(3)
  att1, mask = _attention(rng, 2, [4, 4], 2, 4)
  att2, _ = _attention(rng, 2, [4, 4], 2, 4)
  att1[:, 1, 0] = 0.0  # one slice pair without a single valid cell: m falls to 0
  fn = lambda a: _official_loss(a, att2, jax.random.PRNGKey(0), weight=LAMBDA, num_samples=150)[0]
  assert float(fn(att1)) == 0.0
  grad = jax.grad(fn)(jnp.asarray(att1))
  assert np.all(np.isfinite(np.asarray(grad)))
  # And with usable cells the gradient is finite and non-zero; the scale carries none.
  att1b, _ = _attention(rng, 2, [4, 3], 2, 4)
  grad_b = np.asarray(jax.grad(fn)(jnp.asarray(att1b)))
  assert np.all(np.isfinite(grad_b)) and np.any(grad_b != 0)


def test_paper_variant_is_unchanged():
  options = dict(heads_per_slice=2, pool_layers=False, min_valid=3)
  rng = np.random.default_rng(4)
  att1, mask = _attention(rng, 2, [6, 3, 5], 4, 6)
  att2, _ = _attention(rng, 2, [6, 3, 5], 4, 6)
  key = jax.random.PRNGKey(9)
  paper, m_paper = _loss(att1, att2, mask, key, num_samples=20, **options)
  assert 'ami_scale' not in m_paper
  # The paper loss is -lambda * mean MI over counted pairs of the per-pair result.
  res = _paper_ami(att1, att2, mask, key, num_samples=20, **options)
  w = np.asarray(res.weight)
  np.testing.assert_allclose(float(paper), -2.5e-3 * (np.asarray(res.mi) * w).sum() / w.sum(),
                             rtol=1e-6)
  official, _ = _official_loss(att1, att2, key, num_samples=20)
  assert float(official) != float(paper)
