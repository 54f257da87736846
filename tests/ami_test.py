"""Tests for micse_jax.losses.ami against an independent, loop-based NumPy version."""
import functools

import jax
import jax.extend  # jaxprs_in_params
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from micse_jax.losses import ami

KEY = jax.random.PRNGKey(0)
_STATIC = ('num_samples', 'heads_per_slice', 'pool_layers', 'require_positive', 'min_valid')
_ami_jit = jax.jit(ami.attention_mutual_information, static_argnames=_STATIC)
_loss_jit = jax.jit(ami.ami_loss, static_argnames=_STATIC)


_DEFAULTS = dict(num_samples=150, heads_per_slice=2, pool_layers=False, require_positive=True,
                 min_valid=3, log_eps=1e-12, rho2_eps=1e-4)


# Jitted, because eager op-by-op dispatch would dominate the test time. Every
# option is always passed (floats traced), so that equal settings share a compile.
def _ami(att1, att2, mask, key, **options):
  return _ami_jit(att1, att2, mask, key, **{**_DEFAULTS, **options})


def _loss(att1, att2, mask, key, **options):
  return _loss_jit(att1, att2, mask, key, **{'weight': 2.5e-3, **_DEFAULTS, **options})


# ----------------------------------------------------------------- NumPy reference
def _np_attention(rng, num_layers, lengths, heads, length, drop=0.0):
  """Softmax attention over real keys, `[L, B, H, T, T]`, with optional exact zeros.

  Padding keys get exactly 0 (exp underflow); an all-padding sentence is uniform.
  """
  batch = len(lengths)
  mask = (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  scores = rng.normal(size=(num_layers, batch, heads, length, length))
  scores = np.where(mask[None, :, None, None, :] > 0, scores, -1e4)  # HF-style key mask
  att = np.exp(scores - scores.max(-1, keepdims=True))
  att /= att.sum(-1, keepdims=True)
  if drop:
    att = np.where(rng.random(att.shape) < drop, 0.0, att / (1 - drop))
  return att.astype(np.float32), mask


def _np_slices(num_layers, heads, heads_per_slice, pool_layers):
  """List of slices, each a list of (layer, head), in the order the module uses."""
  groups = [list(range(g * heads_per_slice, (g + 1) * heads_per_slice))
            for g in range(heads // heads_per_slice)]
  if pool_layers:
    return [[(l, h) for l in range(num_layers) for h in grp] for grp in groups]
  return [[(l, h) for h in grp] for l in range(num_layers) for grp in groups]


def _np_mi(x1, x2, log_eps, rho2_eps):
  u = np.log(np.maximum(np.asarray(x1, np.float64), log_eps))
  v = np.log(np.maximum(np.asarray(x2, np.float64), log_eps))
  rho = np.corrcoef(u, v)[0, 1]
  return -0.5 * np.log(1 - min(rho * rho, 1 - rho2_eps)), rho


def _np_ami_all_cells(att1, att2, mask, heads_per_slice=2, pool_layers=False,
                      require_positive=True, log_eps=1e-12, rho2_eps=1e-4):
  """MI / rho / weight per (sentence, slice) using every valid cell."""
  num_layers, batch, heads, length, _ = att1.shape
  slices = _np_slices(num_layers, heads, heads_per_slice, pool_layers)
  mi = np.zeros((batch, len(slices)))
  rho = np.zeros_like(mi)
  weight = np.zeros_like(mi)
  count = np.zeros_like(mi)
  for b in range(batch):
    for s, cells in enumerate(slices):
      x1, x2 = [], []
      for l, h in cells:
        for q in range(length):
          for k in range(length):
            a, c = att1[l, b, h, q, k], att2[l, b, h, q, k]
            if not (mask[b, q] and mask[b, k]):
              continue
            if require_positive and not (a > 0 and c > 0):
              continue
            x1.append(a)
            x2.append(c)
      count[b, s] = len(x1)
      if len(x1) >= 3 and np.std(x1) > 0 and np.std(x2) > 0:
        mi[b, s], rho[b, s] = _np_mi(x1, x2, log_eps, rho2_eps)
        weight[b, s] = 1.0
  return mi, rho, weight, count


def _all_cells(att, heads_per_slice, pool_layers):
  num_layers, _, _, length, _ = att.shape
  per_layer = heads_per_slice * length * length
  return per_layer * (num_layers if pool_layers else 1)


def _assert_matches_reference(res, ref, atol=2e-4):
  mi, rho, weight, count = ref
  np.testing.assert_array_equal(res.weight, weight)
  np.testing.assert_array_equal(res.num_valid, count)
  np.testing.assert_allclose(res.rho, rho, atol=atol)
  np.testing.assert_allclose(res.mi, mi, atol=atol, rtol=1e-3)


# Most tests share one shape and a few static settings so that the jitted
# functions compile only a handful of times: [L, B, H, T, T] = [2, 4, 4, 8, 8].
NUM_LAYERS, HEADS, LENGTH = 2, 4, 8
ALL_CELLS = 2 * LENGTH * LENGTH  # per slice of 2 heads of one layer
SAMPLES = 50


def _views(seed, lengths, drop=0.0):
  rng = np.random.default_rng(seed)
  att1, mask = _np_attention(rng, NUM_LAYERS, lengths, HEADS, LENGTH, drop)
  att2, _ = _np_attention(rng, NUM_LAYERS, lengths, HEADS, LENGTH, drop)
  return att1, att2, mask


# ------------------------------------------------------------ deterministic core
@pytest.mark.parametrize('heads_per_slice,pool_layers', [(2, False), (1, False), (2, True)])
def test_all_cells_match_numpy_with_padding(heads_per_slice, pool_layers):
  att1, att2, mask = _views(0, [8, 3, 1, 6])
  att2 = np.where(att1 > 0, 0.5 * att1 + att2, 0.0).astype(np.float32)  # correlated views
  num = _all_cells(att1, heads_per_slice, pool_layers)
  res = _ami(att1, att2, mask, KEY, num_samples=num, heads_per_slice=heads_per_slice,
             pool_layers=pool_layers)
  ref = _np_ami_all_cells(att1, att2, mask, heads_per_slice, pool_layers)
  _assert_matches_reference(res, ref)
  assert np.all(np.asarray(res.weight)[[0, 1, 3]] == 1)
  # Sentence 2 has a single real token: one cell per head, always exactly 1.0
  # (too few samples, or constant ones when layers are pooled).
  assert np.all(np.asarray(res.weight)[2] == 0)


def test_fewer_valid_cells_than_samples():
  lengths = [4, 2, 1, 8]  # 32, 8, 2 and 128 valid cells per slice of 2 heads x 8 x 8.
  att1, att2, mask = _views(1, lengths)
  res = _ami(att1, att2, mask, KEY, num_samples=SAMPLES)
  assert res.indices.shape == (4, NUM_LAYERS * HEADS // 2, SAMPLES)
  np.testing.assert_array_equal(np.asarray(res.sample_weight).sum(-1),
                                np.repeat([[32], [8], [2], [SAMPLES]], 4, axis=1))
  ref = _np_ami_all_cells(att1, att2, mask)
  # Sentences 0-2 take all their valid cells; sentence 3 is a proper subsample.
  _assert_matches_reference(ami.AMIResult(*[x[:3] for x in res]), tuple(x[:3] for x in ref))
  np.testing.assert_array_equal(res.weight, [[1] * 4, [1] * 4, [0] * 4, [1] * 4])
  loss, metrics = _loss(att1, att2, mask, KEY, num_samples=SAMPLES, weight=1.0)
  valid_mi = np.asarray(res.mi)[[0, 1, 3]]
  np.testing.assert_allclose(metrics['ami_mi'], valid_mi.mean(), rtol=1e-5)
  np.testing.assert_allclose(loss, -metrics['ami_mi'], rtol=1e-6)
  np.testing.assert_allclose(metrics['ami_pairs'], 3 / 4, rtol=1e-6)
  np.testing.assert_allclose(metrics['ami_samples'], (32 + 8 + SAMPLES) / 3, rtol=1e-6)


@pytest.mark.parametrize('require_positive', [True, False])
def test_dropout_zeros(require_positive):
  att1, att2, mask = _views(2, [8, 5, 4, 7], drop=0.3)
  att2 = np.where((att1 > 0) & (att2 > 0), att1 * att2 ** 0.3, att2).astype(np.float32)
  assert np.sum(att1 == 0) > 0
  log_eps = 1e-3
  res = _ami(att1, att2, mask, KEY, num_samples=ALL_CELLS, require_positive=require_positive,
             log_eps=log_eps)
  ref = _np_ami_all_cells(att1, att2, mask, require_positive=require_positive, log_eps=log_eps)
  _assert_matches_reference(res, ref)
  assert np.all(np.isfinite(res.mi)) and np.all(np.isfinite(res.rho))


def test_sampled_values_match_numpy_on_returned_indices():
  att1, att2, mask = _views(3, [8, 6, 7, 8], drop=0.1)
  res = _ami(att1, att2, mask, KEY, num_samples=SAMPLES)
  slices = _np_slices(NUM_LAYERS, HEADS, 2, False)
  for b in range(4):
    for s, cells in enumerate(slices):
      idx = np.asarray(res.indices[b, s])
      assert np.all(np.asarray(res.sample_weight[b, s]) == 1)
      head_in_group, q, k = np.unravel_index(idx, (2, LENGTH, LENGTH))
      layer_head = [cells[i] for i in head_in_group]
      x1 = np.array([att1[l, b, h, qq, kk] for (l, h), qq, kk in zip(layer_head, q, k)])
      x2 = np.array([att2[l, b, h, qq, kk] for (l, h), qq, kk in zip(layer_head, q, k)])
      assert np.all(mask[b, q] > 0) and np.all(mask[b, k] > 0)
      assert np.all(x1 > 0) and np.all(x2 > 0)
      mi, rho = _np_mi(x1, x2, 1e-12, 1e-4)
      np.testing.assert_allclose(res.rho[b, s], rho, atol=2e-4)
      np.testing.assert_allclose(res.mi[b, s], mi, atol=2e-4, rtol=1e-3)


def test_mi_from_samples_weighted():
  rng = np.random.default_rng(4)
  x1 = rng.random((3, 10)).astype(np.float32) + 0.01
  x2 = (x1 * rng.random((3, 10)) + 0.01).astype(np.float32)
  w = np.ones((3, 10), np.float32)
  w[0, 6:] = 0
  w[1, 2:] = 0  # 2 valid samples: weight 0.
  x1[0, 6:] = 0.0  # A zero in a zero-weight slot must not matter.
  mi, rho, pair_w, count = jax.jit(ami.mi_from_samples)(x1, x2, w)
  np.testing.assert_array_equal(pair_w, [1, 0, 1])
  np.testing.assert_array_equal(count, [6, 2, 10])
  np.testing.assert_allclose(rho[0], _np_mi(x1[0, :6], x2[0, :6], 1e-12, 1e-4)[1], atol=1e-5)
  np.testing.assert_allclose(mi[2], _np_mi(x1[2], x2[2], 1e-12, 1e-4)[0], atol=1e-5)
  assert mi[1] == 0 and rho[1] == 0


def test_identical_views_rho_one_and_clamped_mi():
  att, _, mask = _views(5, [8, 5, 7, 8], drop=0.1)
  # Sampled (num_samples < cells): rho == 1 also shows both views use the same
  # cells. A positive rescaling of a view only shifts its logs: still rho == 1.
  loss, metrics = _loss(att, 3.0 * att, mask, KEY, num_samples=SAMPLES)
  clamp = -0.5 * np.log(1e-4)
  np.testing.assert_allclose(metrics['ami_rho'], 1.0, atol=1e-5)
  np.testing.assert_allclose(metrics['ami_mi'], clamp, rtol=1e-4)
  np.testing.assert_allclose(loss, -2.5e-3 * clamp, rtol=1e-4)
  _, metrics = _loss(att, 3.0 * att, mask, KEY, num_samples=SAMPLES, rho2_eps=1e-2)
  np.testing.assert_allclose(metrics['ami_mi'], -0.5 * np.log(1e-2), rtol=1e-4)


def test_independent_views_rho_near_zero():
  att1, att2, mask = _views(6, [8] * 4)
  res = _ami(att1, att2, mask, KEY, num_samples=ALL_CELLS)
  rho = np.asarray(res.rho)
  assert np.all(np.asarray(res.weight) == 1)
  # 16 pairs of 128 samples each: sd(rho) ~ 0.09 per pair, ~ 0.022 for the mean.
  assert abs(rho.mean()) < 0.08
  assert np.abs(rho).max() < 0.4
  assert np.asarray(res.mi).mean() < 0.02


def test_different_keys_give_different_samples():
  att1, att2, mask = _views(9, [8] * 4)
  a = _ami(att1, att2, mask, jax.random.PRNGKey(1), num_samples=SAMPLES)
  b = _ami(att1, att2, mask, jax.random.PRNGKey(2), num_samples=SAMPLES)
  assert np.mean(np.sort(a.indices, -1) != np.sort(b.indices, -1)) > 0.5


def test_fold_layer_parity_matches_official_slicing():
  rng = np.random.default_rng(7)
  att, _ = _np_attention(rng, 4, [3, 3], 2, 3)
  sliced = np.asarray(ami.slice_attention(ami.fold_layer_parity(att), 1, True))
  assert sliced.shape == (2, 4, 2 * 9)
  for b in range(2):
    for parity in range(2):
      for h in range(2):
        expected = np.concatenate([att[2 * j + parity, b, h].ravel() for j in range(2)])
        np.testing.assert_array_equal(sliced[b, parity * 2 + h], expected)


# --------------------------------------------------------------------- sampling
def test_sample_cells_distinct_valid_and_roughly_uniform():
  rng = np.random.default_rng(8)
  # Rows 0-12: 0..12 valid cells in random places (fewer than, as many as and
  # more than the 3 samples). Then 4000 rows of one fixed pattern of 8 cells.
  varied = np.stack([rng.permutation(12) < n for n in range(13)])
  pattern = np.zeros(12, bool)
  pattern[[0, 2, 3, 5, 7, 8, 10, 11]] = True
  valid = np.concatenate([varied, np.tile(pattern, (4000, 1))])
  idx, w = jax.jit(ami.sample_cells, static_argnums=2)(jnp.asarray(valid), KEY, 3)
  idx, w = np.asarray(idx), np.asarray(w)
  for row in range(len(valid)):
    assert len(set(idx[row])) == 3
    assert w[row].sum() == min(3, valid[row].sum())
    np.testing.assert_array_equal(valid[row][idx[row]], w[row] > 0)
  counts = np.bincount(idx[13:].ravel(), minlength=12)
  expected = 4000 * 3 / 8
  assert np.all(counts[~pattern] == 0)
  assert np.all(np.abs(counts[pattern] - expected) < 0.1 * expected), counts


# ---------------------------------------------------- gradients, jit and memory
def test_gradients_match_finite_differences():
  rng = np.random.default_rng(10)
  att1, mask = _np_attention(rng, 1, [3, 2], 2, 3)
  att2, _ = _np_attention(rng, 1, [3, 2], 2, 3)
  loss_fn = functools.partial(ami.ami_loss, attention_mask=mask, rng=KEY, weight=1.0,
                              num_samples=8, heads_per_slice=2)
  with jax.enable_x64(True):
    args = (jnp.asarray(att1, jnp.float64), jnp.asarray(att2, jnp.float64))
    check_grads(jax.jit(lambda a, b: loss_fn(a, b)[0]), args, order=1, modes=('rev',),
                atol=1e-4, rtol=1e-4, eps=1e-6)


@pytest.mark.parametrize('require_positive', [True, False])
def test_gradients_finite_in_degenerate_cases(require_positive):
  # Lengths 1 and 0: constant or empty slices. Sentence 3: identical views, so
  # rho^2 hits the clamp. Dropout zeros everywhere.
  att1, att2, mask = _views(11, [8, 1, 0, 2], drop=0.3)
  att2[:, 1:] = att1[:, 1:]

  def loss_fn(a, b, m):
    return ami.ami_loss(a, b, m, KEY, num_samples=SAMPLES, require_positive=require_positive)

  grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))
  (loss, metrics), grads = grad_fn(att1, att2, mask)
  assert np.isfinite(loss) and all(np.isfinite(v) for v in metrics.values())
  assert metrics['ami_mi'] > 0
  for g in grads:
    assert np.all(np.isfinite(g)) and np.any(g != 0)
  # No real token at all: no valid pair, loss 0, zero (finite) gradients.
  (loss, metrics), grads = grad_fn(att1, att2, np.zeros_like(mask))
  assert loss == 0 and metrics['ami_pairs'] == 0
  for g in grads:
    assert np.all(g == 0)


def test_bf16_attention():
  att1, _, mask = _views(12, [8, 5, 6, 7])
  att2 = np.sqrt(att1)
  loss, metrics = _loss(jnp.asarray(att1, jnp.bfloat16), jnp.asarray(att2, jnp.bfloat16),
                        mask, KEY, num_samples=SAMPLES)
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(metrics['ami_rho'], 1.0, atol=1e-2)


def _max_intermediate_size(jaxpr):
  biggest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      biggest = max(biggest, int(np.prod(var.aval.shape)))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):  # jax.core's copy is gone in jax 0.11+
      biggest = max(biggest, _max_intermediate_size(sub))
  return biggest


def test_no_intermediate_larger_than_attention_bert_base():
  # BERT-base, batch 50, length 32, 4 layers, 12 heads: traced only, never run.
  shape = (4, 50, 12, 32, 32)
  att = jax.ShapeDtypeStruct(shape, jnp.float32)
  mask = jax.ShapeDtypeStruct((50, 32), jnp.int32)
  fn = jax.jit(jax.value_and_grad(lambda a, b, m, k: _loss(a, b, m, k)[0], argnums=(0, 1)))
  jaxpr = jax.make_jaxpr(fn)(att, att, mask, KEY)
  assert _max_intermediate_size(jaxpr.jaxpr) <= int(np.prod(shape))
