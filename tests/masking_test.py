"""Tests for micse_jax.augmentation.masking and special_tokens (MLM 80/10/10, Mirror-BERT spans)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.augmentation import masking
from micse_jax.augmentation.special_tokens import special_token_mask

CLS, SEP, MASK, VOCAB = 101, 102, 103, 30522


def _batch(lengths, length, seed=0):
  """BERT-like rows: [CLS] words [SEP] then padding (id 0)."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((len(lengths), length), np.int32)
  mask = np.zeros((len(lengths), length), np.int32)
  for row, n in enumerate(lengths):
    ids[row, :n] = rng.integers(1000, VOCAB, n)
    ids[row, 0], ids[row, n - 1] = CLS, SEP
    mask[row, :n] = 1
  special = np.isin(ids, [CLS, SEP]) & (mask > 0)
  return ids, mask, special


def test_special_token_mask_hand_made():
  ids = jnp.array([[CLS, 7, 8, SEP, 0, 0], [CLS, 9, SEP, 0, 0, 0]])
  mask = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
  got = special_token_mask(ids, mask, CLS, SEP)
  want = [[1, 0, 0, 1, 0, 0], [1, 0, 1, 0, 0, 0]]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want, bool))
  # A special id sitting in padding is not a real token; extra ids count when asked.
  ids2 = ids.at[1, 4].set(SEP).at[0, 1].set(MASK)
  got2 = special_token_mask(ids2, mask, CLS, SEP, extra_ids=(MASK,))
  want2 = np.asarray(want, bool)
  want2[0, 1] = True
  np.testing.assert_array_equal(np.asarray(got2), want2)


_mlm = jax.jit(functools.partial(masking.mlm_mask, vocab_size=VOCAB, mask_token_id=MASK))


def test_mlm_mask_rates_and_positions():
  lengths = [32, 20, 9, 3, 2] * 400
  ids, mask, special = _batch(lengths, 32)
  masked, labels, weights = map(np.asarray, _mlm(jax.random.PRNGKey(0), ids, mask, special))
  candidate = (mask > 0) & ~special
  selected = weights > 0
  # Only real, non-special tokens are ever selected or changed.
  assert not np.any(selected & ~candidate)
  np.testing.assert_array_equal(masked[~selected], ids[~selected])
  np.testing.assert_array_equal(labels, ids)  # labels are the original ids
  rate = selected.sum() / candidate.sum()
  n_sel = selected.sum()
  assert abs(rate - 0.15) < 4 * np.sqrt(0.15 * 0.85 / candidate.sum())
  to_mask = (masked == MASK) & selected
  changed = (masked != ids) & selected & ~to_mask
  kept = (masked == ids) & selected
  for count, p in ((to_mask.sum(), 0.8), (changed.sum(), 0.1), (kept.sum(), 0.1)):
    assert abs(count / n_sel - p) < 4 * np.sqrt(p * (1 - p) / n_sel), (count / n_sel, p)
  assert masked.min() >= 0 and masked.max() < VOCAB
  assert weights.dtype == np.float32


def test_mlm_mask_deterministic_per_key():
  ids, mask, special = _batch([16] * 8, 16)
  a = np.asarray(_mlm(jax.random.PRNGKey(1), ids, mask, special)[0])
  b = np.asarray(_mlm(jax.random.PRNGKey(1), ids, mask, special)[0])
  c = np.asarray(_mlm(jax.random.PRNGKey(2), ids, mask, special)[0])
  np.testing.assert_array_equal(a, b)
  assert np.any(a != c)


def test_mlm_mask_all_mask_option():
  ids, mask, special = _batch([16] * 64, 16)
  masked, _, weights = masking.mlm_mask(jax.random.PRNGKey(3), ids, mask, special,
                                        vocab_size=VOCAB, mask_token_id=MASK, prob=1.0,
                                        mask_frac=1.0, random_frac=0.0)
  candidate = (mask > 0) & ~special
  np.testing.assert_array_equal(np.asarray(weights) > 0, candidate)
  np.testing.assert_array_equal(np.asarray(masked), np.where(candidate, MASK, ids))
  with pytest.raises(ValueError, match='mask_frac'):
    masking.mlm_mask(jax.random.PRNGKey(3), ids, mask, special, vocab_size=VOCAB,
                     mask_token_id=MASK, mask_frac=0.9, random_frac=0.2)


_span = jax.jit(masking.span_mask, static_argnames=('span_length', 'mask_token_id', 'min_tokens'))


@pytest.mark.parametrize('span_length', [1, 3])
def test_span_mask_one_contiguous_span(span_length):
  lengths = [12, 7, 5, 4, 3, 2, 12] * 300
  ids, mask, special = _batch(lengths, 12)
  out = np.asarray(_span(jax.random.PRNGKey(0), ids, mask, special, span_length=span_length,
                         mask_token_id=MASK))
  starts = {}
  for row, n in enumerate(lengths):
    words = n - 2  # maskable tokens sit at positions 1 .. n-2
    changed = np.flatnonzero(out[row] != ids[row])
    assert np.all(out[row, changed] == MASK)
    if words <= span_length:
      assert changed.size == 0
      continue
    assert changed.size == span_length
    np.testing.assert_array_equal(changed, np.arange(changed[0], changed[0] + span_length))
    # Never a special token, never padding, never the last word.
    assert changed[0] >= 1 and changed[-1] <= n - 3
    starts.setdefault(n, []).append(changed[0] - 1)
  # Start rank is uniform over 0 .. words - span_length - 1.
  for n, s in starts.items():
    choices = n - 2 - span_length
    hist = np.bincount(s, minlength=choices)
    assert hist.size == choices and hist.min() > 0
    expected = len(s) / choices
    assert np.all(np.abs(hist - expected) < 5 * np.sqrt(expected)), (n, hist)


def test_span_mask_min_tokens_and_noncontiguous_candidates():
  ids, mask, special = _batch([10, 6], 10)
  out = np.asarray(masking.span_mask(jax.random.PRNGKey(0), ids, mask, special, span_length=2,
                                     mask_token_id=MASK, min_tokens=6))
  np.testing.assert_array_equal(out[1], ids[1])  # 4 words < min_tokens 6
  assert (out[0] == MASK).sum() == 2
  # A special token in the middle is skipped over: the span counts maskable tokens only.
  special2 = special.copy()
  special2[0, 2:8] = True  # only positions 1 and 8 remain maskable, span 1 -> start rank 0
  out2 = np.asarray(masking.span_mask(jax.random.PRNGKey(5), ids, mask, special2, span_length=1,
                                      mask_token_id=MASK))
  assert np.flatnonzero(out2[0] != ids[0]).tolist() == [1]


def test_span_mask_text():
  rng = np.random.default_rng(0)
  short = 'A short one.'
  assert masking.span_mask_text(short, rng) == short
  text = 'The quick brown fox jumps over the lazy dog again.'
  seen = set()
  for _ in range(400):
    out = masking.span_mask_text(text, rng)
    left, right = out.split(' [MASK] ')
    assert len(left) + len(right) == len(text) - 5
    assert text.startswith(left) and text.endswith(right)
    seen.add(len(left))
  assert seen == set(range(len(text) - 5))
