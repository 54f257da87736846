"""SimCSE's augmentation: two dropout views of the same sentences, one train-mode forward of both
(Gao et al. 2021, Sec. 3), their rows interleaved so each sentence's two views sit side by side.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from micse_jax.models.bert import BertModel, collect_attentions
from micse_jax.tokenization import TOKEN_KEYS


def two_dropout_views(model: BertModel, params, view1: dict, view2: dict, key: jax.Array):
  """One train-mode forward of both views (token batches, `TOKEN_KEYS`), interleaved per
  sentence (`interleave_views`): each row gets its own dropout mask. Returns (hidden1, hidden2
  `[B, T, H]`, att1, att2 `[L, B, heads, T, T]`), the attention of `model.sow_attention_layers`
  (None, None when it sows none)."""
  both = interleave_views({k: view1[k] for k in TOKEN_KEYS}, {k: view2[k] for k in TOKEN_KEYS})
  out, state = model.apply({"params": params}, *(both[k] for k in TOKEN_KEYS), deterministic=False,
                           rngs={"dropout": key}, mutable=["intermediates"])
  hidden1, hidden2 = split_views(out.last_hidden_state)
  if not model.sow_attention_layers:
    return hidden1, hidden2, None, None
  att1, att2 = split_views(collect_attentions(state["intermediates"], model.sow_attention_layers), axis=1)
  return hidden1, hidden2, att1, att2


def interleave_views(view1: dict, view2: dict) -> dict:
  """Rows `[v1_0, v2_0, v1_1, v2_1, ...]` of every array of two token batches
  (`stack(..., 1).reshape(2B, ...)`), not `[view1; view2]`.

  A device that holds sentences i..j of the batch-sharded input holds both views of exactly
  those sentences, so stacking and splitting the views moves no activation between devices;
  and row 2i+v is the same whatever the batch's padded size (per-row random draws too).
  """
  return {k: jnp.stack([view1[k], view2[k]], axis=1).reshape(-1, *view1[k].shape[1:]) for k in view1}


def split_views(x: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
  """Inverse of `interleave_views` along `axis` (size 2B): the two `[..., B, ...]` views."""
  pairs = x.reshape(*x.shape[:axis], x.shape[axis] // 2, 2, *x.shape[axis + 1:])
  return jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)
