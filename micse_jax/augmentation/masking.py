"""Token masking views: BERT's MLM corruption and Mirror-BERT's random span masking.

* `mlm_mask`: the masked-language-model corruption of BERT (Devlin et al. 2019,
  Sec. 3.1, "Task #1") as used by SimCSE's `--do_mlm` auxiliary objective
  (public SimCSE code), ADD and InforMin-CL: 15 % of the real, non-special tokens
  are selected; of those 80 % become [MASK], 10 % a random token and 10 % stay.
* `span_mask` / `span_mask_text`: Mirror-BERT's second view (Liu et al. 2021,
  Sec. 2, "random span masking"): one random contiguous span is replaced by
  [MASK].

All arrays returned are new ones: the contrastive inputs are never edited in
place (the MLM loss runs on a copy of the batch).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _maskable(attention_mask: jax.Array, special_mask: jax.Array) -> jax.Array:
  """Real tokens that are not special: the only ones a view may corrupt."""
  return attention_mask.astype(bool) & ~special_mask.astype(bool)


def mlm_mask(rng: jax.Array, input_ids: jax.Array, attention_mask: jax.Array,
             special_mask: jax.Array, *, vocab_size: int, mask_token_id: int,
             prob: float = 0.15, mask_frac: float = 0.8,
             random_frac: float = 0.1) -> tuple[jax.Array, jax.Array, jax.Array]:
  """BERT's MLM corruption (Devlin et al. 2019, Sec. 3.1) on a copy of `input_ids`.

  Every real, non-special token is selected independently with probability
  `prob`; a selected token becomes [MASK] with probability `mask_frac`, a token
  drawn uniformly from `[0, vocab_size)` with probability `random_frac`, and
  stays as it is otherwise (80/10/10 by default, as in BERT, SimCSE's
  `--do_mlm` and the HF data collator SimCSE uses).

  Args:
    rng: PRNG key.
    input_ids: `[B, T]` int token ids (not modified).
    attention_mask: `[B, T]`, 1 for real tokens.
    special_mask: `[B, T]` bool, True at [CLS]/[SEP] (see `special_token_mask`).
    vocab_size: size of the vocabulary random replacements are drawn from.
    mask_token_id: id of [MASK].
    prob: selection probability (0.15 in BERT/SimCSE/miCSE's public code).
    mask_frac: fraction of the selected tokens replaced by [MASK].
    random_frac: fraction of the selected tokens replaced by a random token.

  Returns:
    (masked_ids `[B, T]`, labels `[B, T]` = the original ids, label_weights
    `[B, T]` float32, 1.0 at the selected positions). The loss is
    `losses.mlm.mlm_loss(logits, labels, label_weights)`.
  """
  if not 0.0 <= mask_frac + random_frac <= 1.0:
    raise ValueError(f'mask_frac + random_frac must lie in [0, 1], got {mask_frac + random_frac}')
  k_select, k_action, k_token = jax.random.split(rng, 3)
  selected = jax.random.bernoulli(k_select, prob, input_ids.shape)
  selected = selected & _maskable(attention_mask, special_mask)
  # One uniform draw per position decides between [MASK], random and unchanged.
  action = jax.random.uniform(k_action, input_ids.shape)
  to_mask = selected & (action < mask_frac)
  to_random = selected & (action >= mask_frac) & (action < mask_frac + random_frac)
  random_ids = jax.random.randint(k_token, input_ids.shape, 0, vocab_size, input_ids.dtype)
  masked = jnp.where(to_mask, jnp.asarray(mask_token_id, input_ids.dtype), input_ids)
  masked = jnp.where(to_random, random_ids, masked)
  return masked, input_ids, selected.astype(jnp.float32)


def span_mask(rng: jax.Array, input_ids: jax.Array, attention_mask: jax.Array,
              special_mask: jax.Array, *, span_length: int, mask_token_id: int,
              min_tokens: int = 0) -> jax.Array:
  """Mirror-BERT's random span masking (Liu et al. 2021, Sec. 2), on token ids.

  In each row one contiguous run of `span_length` real, non-special tokens is
  replaced by [MASK] (one [MASK] per token, so shapes and the attention mask
  are unchanged). With c maskable tokens the span starts uniformly at rank
  0 .. c - span_length - 1, so, as in the public code's choice of start, the
  last maskable token (usually the final punctuation) is never covered. Rows
  with c <= span_length or c < `min_tokens` are left unchanged.

  Departure from the public code (cambridgeltl/mirror-bert,
  `src/data_loader.py`): it masks on the raw *string*, erasing `mask_len=5`
  characters (sentences under 30 characters untouched) and inserting a single
  " [MASK] " in their place, which re-tokenizes into one [MASK] and may split a
  word. Here the span is counted in word pieces; 5 English characters are
  about 1-2 word pieces. `span_mask_text` gives the character-level form for
  a text pipeline.

  Args:
    rng: PRNG key.
    input_ids: `[B, T]` token ids (not modified).
    attention_mask: `[B, T]`, 1 for real tokens.
    special_mask: `[B, T]` bool, True at [CLS]/[SEP].
    span_length: tokens per span (>= 1).
    mask_token_id: id of [MASK].
    min_tokens: rows with fewer maskable tokens are left unchanged.

  Returns:
    `[B, T]` new token ids.
  """
  if span_length < 1:
    raise ValueError(f'span_length must be >= 1, got {span_length}')
  maskable = _maskable(attention_mask, special_mask)
  rank = jnp.cumsum(maskable, axis=1) - 1  # rank among maskable tokens
  count = jnp.sum(maskable, axis=1)
  choices = jnp.maximum(count - span_length, 1)
  start = jnp.floor(jax.random.uniform(rng, count.shape) * choices).astype(rank.dtype)
  start = jnp.minimum(start, choices - 1)
  apply = (count > span_length) & (count >= min_tokens)
  in_span = maskable & (rank >= start[:, None]) & (rank < start[:, None] + span_length)
  in_span = in_span & apply[:, None]
  return jnp.where(in_span, jnp.asarray(mask_token_id, input_ids.dtype), input_ids)


def span_mask_text(text: str, rng: np.random.Generator, *, span_chars: int = 5,
                   min_chars: int = 30, mask_token: str = '[MASK]') -> str:
  """Mirror-BERT's span masking on a raw sentence (character level, for a data pipeline).

  Sentences shorter than `min_chars` characters (or not longer than
  `span_chars`) are returned unchanged; otherwise the `span_chars` characters
  starting at a uniform position in `[0, len - span_chars)` are replaced by
  ` [MASK] `. Defaults are the public code's (`--random_span_mask 5`, no
  masking under 30 characters). The public code removes the *first*
  occurrence of the drawn substring, which is an earlier position when that
  substring repeats; this function removes the drawn position itself.
  """
  if len(text) <= span_chars or len(text) < min_chars:
    return text
  start = int(rng.integers(len(text) - span_chars))
  return f'{text[:start]} {mask_token} {text[start + span_chars:]}'
