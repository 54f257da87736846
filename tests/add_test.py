"""Tests for micse_jax.augmentation.add (Attention-Driven Dropout) against loop-based NumPy versions."""
import functools

import jax
import numpy as np
import pytest

from micse_jax.augmentation import add

CLS, SEP, PAD = 101, 102, 0


def _np_attention(rng, num_layers, heads, lengths, length):
  """Softmax attention over real keys; padding query rows also attend to real keys (HF)."""
  mask = (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  scores = rng.normal(size=(num_layers, len(lengths), heads, length, length)) * 2
  scores = np.where(mask[None, :, None, None, :] > 0, scores, -1e4)
  att = np.exp(scores - scores.max(-1, keepdims=True))
  return (att / att.sum(-1, keepdims=True)).astype(np.float32), mask


def _np_naive(att, mask):
  num_layers, batch, heads, length, _ = att.shape
  out = np.zeros((batch, length))
  for b in range(batch):
    for key in range(length):
      for l in range(num_layers):
        for h in range(heads):
          for q in range(length):
            if mask[b, q]:
              out[b, key] += att[l, b, h, q, key]
  return out


def _np_rollout(att, mask, last_layer_only=False):
  num_layers, batch, _, length, _ = att.shape
  out = np.zeros((batch, length))
  for b in range(batch):
    joint = None
    layers = []
    for l in range(num_layers):
      a = att[l, b].astype(np.float64).mean(0) + np.eye(length)
      a = a / a.sum(-1, keepdims=True)
      joint = a if joint is None else a @ joint
      layers.append(joint)
    if last_layer_only:
      layers = layers[-1:]
    for joint in layers:
      out[b] += (joint * mask[b][:, None]).sum(0)
  return out


def test_importance_naive_and_rollout_match_numpy():
  rng = np.random.default_rng(0)
  att, mask = _np_attention(rng, 3, 2, [6, 4, 2], 6)
  np.testing.assert_allclose(np.asarray(add.token_importance_naive(att, mask)),
                             _np_naive(att, mask), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(add.token_importance_naive(att, mask, last_layer_only=True)),
                             _np_naive(att[-1:], mask), rtol=1e-5, atol=1e-5)
  for last in (False, True):
    got = add.token_importance_rollout(att, mask, last_layer_only=last)
    np.testing.assert_allclose(np.asarray(got), _np_rollout(att, mask, last), rtol=1e-5, atol=1e-5)


def test_padding_queries_do_not_change_importance():
  """Real tokens' importance is the same whether or not the batch is padded further."""
  rng = np.random.default_rng(1)
  att, mask = _np_attention(rng, 2, 2, [5], 5)
  padded = np.zeros((2, 1, 2, 8, 8), np.float32)
  padded[..., :5, :5] = att
  padded[..., 5:, :5] = 0.2  # padding query rows attend to real keys, as in HF
  mask8 = np.pad(mask, ((0, 0), (0, 3)))
  for fn in (add.token_importance_naive, add.token_importance_rollout):
    np.testing.assert_allclose(np.asarray(fn(padded, mask8))[:, :5], np.asarray(fn(att, mask)),
                               rtol=1e-5, atol=1e-6)


def _hand_made_attention():
  """One sentence [CLS] a b c d [SEP]; every query attends uniformly except to token 3 (c).

  Token 3 receives no attention at all and [SEP] receives the most, so naive
  importance ranks c lowest; a second map makes b (2) the least attended.
  """
  t = 6
  att = np.zeros((2, 2, 1, t, t), np.float32)
  row = np.array([0.2, 0.2, 0.2, 0.0, 0.1, 0.3], np.float32)
  att[:, 0, 0] = row
  row2 = np.array([0.3, 0.2, 0.05, 0.15, 0.1, 0.2], np.float32)
  att[:, 1, 0] = row2
  mask = np.ones((2, t), np.int32)
  ids = np.array([[CLS, 11, 12, 13, 14, SEP]] * 2, np.int32)
  return att, mask, ids


def test_hand_made_selection_naive():
  att, mask, ids = _hand_made_attention()
  imp = np.asarray(add.token_importance_naive(att, mask))
  # 2 layers x 6 queries x row value.
  np.testing.assert_allclose(imp[0], 12 * np.array([0.2, 0.2, 0.2, 0.0, 0.1, 0.3]), rtol=1e-6)
  special = np.isin(ids, [CLS, SEP])
  batch = {'input_ids': ids, 'attention_mask': mask, 'token_type_ids': np.zeros_like(ids)}
  out = add.drop_least_attended(batch, imp, np.array([1, 1]), special)
  np.testing.assert_array_equal(np.asarray(out['input_ids']),
                                [[CLS, 11, 12, 14, SEP, PAD], [CLS, 11, 13, 14, SEP, PAD]])
  np.testing.assert_array_equal(np.asarray(out['attention_mask']), [[1, 1, 1, 1, 1, 0]] * 2)
  out2 = add.drop_least_attended(batch, imp, np.array([2, 3]), special)
  np.testing.assert_array_equal(np.asarray(out2['input_ids']),
                                [[CLS, 11, 12, SEP, PAD, PAD], [CLS, 11, SEP, PAD, PAD, PAD]])


def test_hand_made_selection_rollout():
  """Rollout on a map where a token is ignored by every head: it ranks lowest."""
  t = 5
  att = np.zeros((2, 1, 2, t, t), np.float32)
  # Each query spreads evenly over all tokens but token 2.
  att[..., :] = np.array([0.25, 0.25, 0.0, 0.25, 0.25], np.float32)
  mask = np.ones((1, t), np.int32)
  imp = np.asarray(add.token_importance_rollout(att, mask))
  np.testing.assert_allclose(imp, _np_rollout(att, mask), rtol=1e-6)
  droppable = imp[0, 1:4]
  assert np.argmin(droppable) == 1  # token 2 (only its identity path survives)


def _np_drop(ids, mask, special, importance, num_drop, pad):
  """Per-row Python reference: sort droppable tokens by (importance, position), remove, pad."""
  out_ids, out_mask = np.full_like(ids, pad), np.zeros_like(mask)
  for b in range(ids.shape[0]):
    candidates = [i for i in range(ids.shape[1]) if mask[b, i] and not special[b, i]]
    candidates.sort(key=lambda i: (importance[b, i], i))
    gone = set(candidates[:num_drop[b]])
    kept = [i for i in range(ids.shape[1]) if mask[b, i] and i not in gone]
    out_ids[b, :len(kept)] = ids[b, kept]
    out_mask[b, :len(kept)] = 1
  return out_ids, out_mask


@pytest.mark.parametrize('pad', [0, 1])
def test_drop_matches_numpy_reference_on_random_batches(pad):
  rng = np.random.default_rng(2)
  lengths = rng.integers(2, 13, 40)
  length = 12
  ids = np.full((40, length), pad, np.int32)
  mask = np.zeros((40, length), np.int32)
  for b, n in enumerate(lengths):
    ids[b, :n] = rng.integers(1000, 2000, n)
    ids[b, 0], ids[b, n - 1] = CLS, SEP
    mask[b, :n] = 1
  special = np.isin(ids, [CLS, SEP]) & (mask > 0)
  importance = rng.integers(0, 5, (40, length)).astype(np.float32)  # many ties
  importance[special] = -10.0  # specials least attended, still never dropped
  importance[mask == 0] = -20.0  # padding too
  num_drop = rng.integers(0, 6, 40)
  types = np.where(mask > 0, np.arange(length)[None] % 2, 0).astype(np.int32)
  batch = {'input_ids': ids, 'attention_mask': mask, 'token_type_ids': types}
  fn = jax.jit(functools.partial(add.drop_least_attended, pad_token_id=pad))
  out = fn(batch, importance, num_drop, special)
  want_ids, want_mask = _np_drop(ids, mask, special, importance, num_drop, pad)
  np.testing.assert_array_equal(np.asarray(out['input_ids']), want_ids)
  np.testing.assert_array_equal(np.asarray(out['attention_mask']), want_mask)
  # Lengths shrink by min(num_drop, droppable); [CLS]/[SEP] survive in place at the ends.
  new_len = np.asarray(out['attention_mask']).sum(1)
  np.testing.assert_array_equal(new_len, lengths - np.minimum(num_drop, lengths - 2))
  for b, n in enumerate(new_len):
    assert want_ids[b, 0] == CLS and want_ids[b, n - 1] == SEP
  # token_type_ids travel with their tokens; zero on padding.
  out_types = np.asarray(out['token_type_ids'])
  for b in range(40):
    kept_pos = [i for i in range(length) if mask[b, i]
                and i not in sorted([i for i in range(length) if mask[b, i] and not special[b, i]],
                                    key=lambda i: (importance[b, i], i))[:num_drop[b]]]
    np.testing.assert_array_equal(out_types[b, :len(kept_pos)], types[b, kept_pos])
    assert np.all(out_types[b, len(kept_pos):] == 0)


def test_num_tokens_to_drop():
  lengths = np.array([2, 9, 10, 11, 19, 20, 32])
  static = add.num_tokens_to_drop(lengths, mode='static', k=2, threshold=10)
  np.testing.assert_array_equal(np.asarray(static), [0, 0, 2, 2, 2, 2, 2])
  dynamic = add.num_tokens_to_drop(lengths, mode='dynamic', k=0, threshold=10)
  np.testing.assert_array_equal(np.asarray(dynamic), [0, 0, 1, 1, 1, 2, 3])
  with pytest.raises(ValueError, match='threshold'):
    add.num_tokens_to_drop(lengths, mode='dynamic', k=1, threshold=0)
  with pytest.raises(ValueError, match='mode'):
    add.num_tokens_to_drop(lengths, mode='sometimes', k=1, threshold=8)
