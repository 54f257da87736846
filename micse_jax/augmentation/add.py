"""Attention-Driven Dropout, ADD (Stermann et al., ECML PKDD 2024, the ADD layer of the method).

ADD builds SimCSE's second view by *removing* the tokens that the current
encoder attends to least. Three steps, each a function here:

1. Token importance from the encoder's attention maps `[L, B, H, T, T]`
   (a forward pass without gradient; see the trainer):
   * naive (`token_importance_naive`): the attention each token receives,
     summed over layers, heads and query positions;
   * rollout (`token_importance_rollout`, Abnar & Zuidema 2020, Sec. 3): per
     layer, heads averaged and the identity added for the residual path, rows
     renormalised; the layers are multiplied, A~_l = A_l A~_{l-1}, and the
     partial products are summed over layers and query positions.
2. How many tokens to drop (`num_tokens_to_drop`): static k (only sentences of
   at least t tokens) or dynamic floor(n / t).
3. Removing them (`drop_least_attended`): the rest shift left, padding is
   appended, and the attention mask and token types follow.

Departures from the public code (fstermann/attention-driven-dropout,
`attention_driven_dropout.py`), all deliberate:
* The public code returns only the new `input_ids` and keeps the old attention
  mask, so the freed trailing positions (now padding ids) are still attended.
  Here the attention mask is rebuilt from the kept tokens.
* The public code may drop [CLS]/[SEP] (only padding is excluded from the
  arg-min); here special tokens are never dropped.
* The public sums also run over the query rows of padding positions; here only
  real query positions count, so a token's importance does not depend on how
  far the batch is padded.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp


def _valid_queries(attention_mask: jax.Array) -> jax.Array:
  """`[1, B, 1, T, 1]` float mask of real query rows, broadcastable to attention."""
  return attention_mask.astype(jnp.float32)[None, :, None, :, None]


def token_importance_naive(att: jax.Array, attention_mask: jax.Array, *,
                           last_layer_only: bool = False) -> jax.Array:
  """Naive ADD importance (ADD method): attention received, summed over layers, heads, queries.

  importance[b, k] = sum_{l, h, q real} att[l, b, h, q, k].

  Args:
    att: `[L, B, H, T, T]` attention probabilities (rows = queries).
    attention_mask: `[B, T]`, 1 for real tokens.
    last_layer_only: use only the last layer (the public code's option).

  Returns:
    `[B, T]` float32. Padding keys get (about) 0; `drop_least_attended`
    excludes them anyway.
  """
  if last_layer_only:
    att = att[-1:]
  att = att.astype(jnp.float32) * _valid_queries(attention_mask)
  return jnp.sum(att, axis=(0, 2, 3))


def attention_rollout(att: jax.Array) -> jax.Array:
  """Attention rollout (Abnar & Zuidema 2020, Sec. 3): `[L, B, T, T]` partial products.

  A_l = normalise_rows(mean_h att_l + I); R_1 = A_1, R_l = A_l R_{l-1}.
  """
  num_layers, _, _, length, _ = att.shape
  mixed = jnp.mean(att.astype(jnp.float32), axis=2) + jnp.eye(length, dtype=jnp.float32)
  mixed = mixed / jnp.sum(mixed, axis=-1, keepdims=True)
  rolled = [mixed[0]]
  for layer in range(1, num_layers):
    rolled.append(jnp.einsum('bqj,bjk->bqk', mixed[layer], rolled[-1]))
  return jnp.stack(rolled)


def token_importance_rollout(att: jax.Array, attention_mask: jax.Array, *,
                             last_layer_only: bool = False) -> jax.Array:
  """Rollout ADD importance (ADD method with Abnar & Zuidema's rollout).

  importance[b, k] = sum_l sum_{q real} R_l[b, q, k], with R_l the rollout up
  to layer l (`attention_rollout`); as in the public code the partial products
  of all layers are summed (`last_layer_only=True`: only the full product R_L).

  Args:
    att: `[L, B, H, T, T]` attention probabilities.
    attention_mask: `[B, T]`, 1 for real tokens.
    last_layer_only: sum only R_L.

  Returns:
    `[B, T]` float32.
  """
  rolled = attention_rollout(att)
  if last_layer_only:
    rolled = rolled[-1:]
  rolled = rolled * attention_mask.astype(jnp.float32)[None, :, :, None]
  return jnp.sum(rolled, axis=(0, 2))


ADD_MODES = ("static", "dynamic")  # `view.add_mode`'s choices (config_checks reads this)
# `view.add_importance`'s choices (config_checks reads the keys; `augmentation/training_views.add_view` calls them)
ADD_IMPORTANCE = {"naive": token_importance_naive, "rollout": token_importance_rollout}


def num_tokens_to_drop(lengths: jax.Array, *, mode: str, k: int, threshold: int) -> jax.Array:
  """How many tokens ADD removes per sentence (ADD's static vs. dynamic dropout rate).

  n = `lengths` counts the real tokens *including* [CLS] and [SEP], as the
  public code's `n_tokens` (every non-padding id) does.
  * static: k if n >= t, else 0 (public defaults k = 1, t = 10);
  * dynamic: floor(n / t) (the README's recommended setting).
  `drop_least_attended` further caps the count at the number of droppable
  (real, non-special) tokens.

  Args:
    lengths: `[B]` int number of real tokens.
    mode: "static" or "dynamic".
    k: tokens dropped in static mode (>= 0).
    threshold: t (>= 1).

  Returns:
    `[B]` int32.
  """
  if threshold < 1:
    raise ValueError(f'ADD threshold t must be >= 1, got {threshold}')
  if k < 0:
    raise ValueError(f'ADD k must be >= 0, got {k}')
  lengths = jnp.asarray(lengths, jnp.int32)
  if mode == 'static':
    return jnp.where(lengths >= threshold, k, 0).astype(jnp.int32)
  if mode == 'dynamic':
    return lengths // threshold
  raise ValueError(f'ADD mode must be one of {ADD_MODES}, got {mode!r}')


def drop_least_attended(batch: Mapping[str, jax.Array], importance: jax.Array,
                        num_drop: jax.Array, special_mask: jax.Array, *,
                        pad_token_id: int = 0) -> dict[str, jax.Array]:
  """Removes the `num_drop` least important droppable tokens per row (ADD method).

  Droppable = real (attention_mask = 1) and not special, so [CLS], [SEP] and
  padding are never removed; ties go to the earlier position. The kept tokens
  move left in their original order and the row is padded on the right. Every
  `[B, T]` array of `batch` is permuted the same way, then set to its padding
  value at the new padding positions: `pad_token_id` for `input_ids`, 0 for
  the rest, and `attention_mask` marks exactly the kept tokens (the public code
  leaves the old attention mask in place; see the module docstring). Position
  ids need no separate update: the encoder derives them from the shifted ids
  (0..T-1 for BERT; from the non-padding ids for RoBERTa, with `pad_token_id`
  = its padding id).

  Static shapes throughout (argsort and gather, no boolean indexing).

  Args:
    batch: dict with at least `input_ids` and `attention_mask` `[B, T]`.
    importance: `[B, T]` token importance (lower = dropped first).
    num_drop: `[B]` int tokens to drop (capped at the droppable count).
    special_mask: `[B, T]` bool, True at special tokens.
    pad_token_id: id written into freed positions of `input_ids`.

  Returns:
    A new dict with the same keys.
  """
  mask = batch['attention_mask']
  batch_size, length = mask.shape
  droppable = mask.astype(bool) & ~special_mask.astype(bool)
  score = jnp.where(droppable, importance.astype(jnp.float32), jnp.inf)
  order = jnp.argsort(score, axis=1, stable=True)
  rank = jnp.argsort(order, axis=1, stable=True)  # rank of each position by score
  dropped = droppable & (rank < jnp.asarray(num_drop)[:, None])
  keep = mask.astype(bool) & ~dropped
  # Kept tokens first, each group in its original order.
  perm = jnp.argsort(jnp.where(keep, 0, 1), axis=1, stable=True)
  new_keep = jnp.take_along_axis(keep, perm, axis=1)
  out = {}
  for name, value in batch.items():
    if getattr(value, 'shape', None) is None or tuple(value.shape[:2]) != (batch_size, length):
      out[name] = value
      continue
    moved = jnp.take_along_axis(value, perm.reshape(perm.shape + (1,) * (value.ndim - 2)), axis=1)
    fill = pad_token_id if name == 'input_ids' else 0
    cond = new_keep.reshape(new_keep.shape + (1,) * (value.ndim - 2))
    out[name] = jnp.where(cond, moved, jnp.asarray(fill, value.dtype))
  out['attention_mask'] = new_keep.astype(mask.dtype)
  return out
