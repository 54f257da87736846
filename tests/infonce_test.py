"""Tests for micse_jax.losses.infonce against an independent NumPy implementation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from micse_jax.losses import infonce
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


# ----------------------------------------------------------------------------- sentence ids (issue 11)

_info_nce_with_ids = jax.jit(_info_nce_loss, static_argnames=('mask_same_sentence',))


def _np_infonce_dropping(z1, z2, queue, keep, tau=0.05):
  """Row by row: anchor i's queue negatives are only the slots with keep[i, k]."""
  z1 = _np_normalize(np.asarray(z1, np.float64))
  z2 = _np_normalize(np.asarray(z2, np.float64))
  q = _np_normalize(np.asarray(queue, np.float64))
  losses = []
  for i in range(len(z1)):
    row = np.concatenate([z1[i] @ z2.T, z1[i] @ q[keep[i]].T]) / tau
    top = row.max()
    losses.append(top + np.log(np.exp(row - top).sum()) - row[i])
  return np.mean(losses)


def _ids_case(seed):
  """6 anchors, a 12-slot queue: 3 empty slots, several slots holding anchors' sentences."""
  z1, z2, rng = _views(seed)
  queue = rng.normal(size=(12, 8)).astype(np.float32)
  anchor_ids = np.array([40, 41, 42, 43, 44, 45], np.int32)
  queue_ids = np.array([41, 7, 40, 41, -1, 45, 9, 8, -1, 43, -1, 11], np.int32)
  valid = queue_ids >= 0
  # A slot of an anchor's sentence that would dominate its row if it were not masked.
  queue[0] = 50 * z1[1]
  return z1, z2, queue, valid, anchor_ids, queue_ids


def test_same_sentence_entries_are_dropped_like_numpy():
  z1, z2, queue, valid, anchor_ids, queue_ids = _ids_case(7)
  same = anchor_ids[:, None] == queue_ids[None, :]  # [B, Q], computed here independently
  loss, metrics = _info_nce_with_ids(z1, z2, queue=queue, queue_valid=valid, anchor_ids=anchor_ids,
                                     queue_ids=queue_ids, mask_same_sentence=True)
  np.testing.assert_allclose(loss, _np_infonce_dropping(z1, z2, queue, valid[None, :] & ~same),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(metrics['queue_self_frac'], same.sum() / same.size, rtol=1e-6)
  np.testing.assert_allclose(metrics['queue_masked_frac'], (~valid[None, :] | same).mean(), rtol=1e-6)
  assert same.sum() == 5  # the case does exercise the mask (anchors 40, 41 twice, 43, 45)


def test_mask_off_is_the_paper_loss_and_still_counts_self_negatives():
  z1, z2, queue, valid, anchor_ids, queue_ids = _ids_case(8)
  loss, metrics = _info_nce_with_ids(z1, z2, queue=queue, queue_valid=valid, anchor_ids=anchor_ids,
                                     queue_ids=queue_ids, mask_same_sentence=False)
  ref = _np_infonce_dropping(z1, z2, queue, np.broadcast_to(valid, (6, 12)))
  np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(metrics['queue_self_frac'], 5 / 72, rtol=1e-6)
  np.testing.assert_allclose(metrics['queue_masked_frac'], 3 / 12, rtol=1e-6)
  masked, _ = _info_nce_with_ids(z1, z2, queue=queue, queue_valid=valid, anchor_ids=anchor_ids,
                                 queue_ids=queue_ids, mask_same_sentence=True)
  assert loss > masked + 0.1  # queue[0] = anchor 1's own sentence, cos 1: the top logit of its row


def test_masked_same_sentence_slots_get_no_gradient():
  z1, z2, queue, valid, anchor_ids, queue_ids = _ids_case(9)
  only_self = np.array([40, 41, 42, 43, 44, 45], np.int32)  # every valid slot is some anchor's...
  queue_ids = np.where(valid, np.resize(only_self, 12), -1).astype(np.int32)
  loss_fn = lambda q: _info_nce_loss(z1, z2, queue=q, queue_valid=valid, anchor_ids=anchor_ids,
                                     queue_ids=queue_ids)[0]
  grad = jax.jit(jax.grad(loss_fn))(queue)
  same = anchor_ids[:, None] == queue_ids[None, :]
  # ...but each slot is masked only for its own anchor: it still gets gradient from the others.
  assert np.all(np.abs(np.asarray(grad)[valid]).sum(axis=1) > 0)
  # With a single anchor, every slot of its sentence is out of the loss.
  single = lambda q: _info_nce_loss(z1[:1], z2[:1], queue=q, queue_valid=valid, anchor_ids=anchor_ids[:1],
                                    queue_ids=queue_ids)[0]
  g1 = np.asarray(jax.jit(jax.grad(single))(queue))
  np.testing.assert_array_equal(g1[same[0]], 0.0)
  assert np.all(np.abs(g1[valid & ~same[0]]).sum(axis=1) > 0)


def test_diagonal_is_each_rows_own_column_whatever_the_others_hold():
  """`infonce.diagonal` (the positives' logits and cosines): x[i, i] of a `[B, B + Q]` array, exactly,
  with infinities and NaN off the diagonal left out; its gradient is 1 on the diagonal only."""
  x = np.random.default_rng(0).normal(size=(4, 7)).astype(np.float32)
  x[0, 3], x[1, 5], x[2, 0] = np.inf, -np.inf, np.nan
  np.testing.assert_array_equal(infonce.diagonal(jnp.asarray(x)), np.diagonal(x))
  grad = jax.grad(lambda x: jnp.sum(infonce.diagonal(x) * jnp.arange(1.0, 5.0)))(jnp.asarray(np.nan_to_num(x)))
  np.testing.assert_array_equal(grad, np.eye(4, 7) * np.arange(1.0, 5.0)[:, None])
