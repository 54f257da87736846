"""The two views of a sentence, as small named functions the train step composes.

Token-level second views (`second_view`): the dropout view (SimCSE: the same tokens, another
dropout mask), the ADD view (Attention-Driven Dropout: the k least-attended tokens removed) and
the Mirror-BERT span-mask view. Encodings (`encode_views`): both views through the online
encoder in one stacked forward pass, or, for Contrastive Tension, view 1 through the online
encoder and view 2 through the second, independent encoder (positives across encoders).
The pure token functions live in `micse_jax/views/`; this file wires them to the networks.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from micse_jax import views as view_fns
from micse_jax.models.bert import collect_attentions

TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def tokens_of(batch: dict) -> dict:
  return {k: batch[k] for k in TOKEN_KEYS}


def token_args(batch: dict) -> tuple:
  """(input_ids, attention_mask, token_type_ids), the positional arguments of `BertModel`."""
  return tuple(batch[k] for k in TOKEN_KEYS)


def special_mask(batch: dict, nets) -> jax.Array:
  t = nets.tokens
  return view_fns.special_token_mask(batch["input_ids"], batch["attention_mask"], t.cls_id, t.sep_id)


def dropout_view(params, batch, key, nets, config) -> dict:
  """SimCSE: view 2 is the same token sequence; only the dropout mask differs."""
  del params, key, nets, config
  return tokens_of(batch)


def span_mask_view(params, batch, key, nets, config) -> dict:
  """Mirror-BERT (Liu et al., EMNLP 2021, §2): one random span replaced by [MASK] in view 2."""
  del params
  ids = view_fns.span_mask(key, batch["input_ids"], batch["attention_mask"], special_mask(batch, nets),
                           span_length=config.view.span_length, mask_token_id=nets.tokens.mask_id)
  return dict(tokens_of(batch), input_ids=ids)


def add_view(params, batch, key, nets, config) -> dict:
  """Attention-Driven Dropout: view 2 drops the k least-attended droppable tokens.

  Importance comes from the current encoder's attention in a forward pass without dropout and
  without gradient (naive: attention received; rollout: Abnar & Zuidema), see `views/add.py`.
  """
  del key
  v = config.view
  tokens = tokens_of(batch)
  _, state = nets.importance.apply({"params": params["encoder"]}, *token_args(tokens), deterministic=True,
                                   mutable=["intermediates"])
  layers = tuple(range(nets.importance.config.num_hidden_layers))
  att = jax.lax.stop_gradient(collect_attentions(state["intermediates"], layers).astype(jnp.float32))
  importance_fn = {"naive": view_fns.token_importance_naive,
                   "rollout": view_fns.token_importance_rollout}[v.add_importance]
  importance = importance_fn(att, batch["attention_mask"])
  num_drop = view_fns.num_tokens_to_drop(batch["attention_mask"].sum(axis=1), mode=v.add_mode,
                                         k=v.add_k, threshold=v.add_threshold)
  return view_fns.drop_least_attended(tokens, importance, num_drop, special_mask(batch, nets))


SECOND_VIEWS: dict[str, Callable] = {"dropout": dropout_view, "add": add_view, "span_mask": span_mask_view}


class Encoded(NamedTuple):
  """Both views' final hidden states `[B, T, H]` and sown attention `[L, B, H, T, T]` (or None)."""
  hidden1: jax.Array
  hidden2: jax.Array
  att1: jax.Array | None
  att2: jax.Array | None


def _attention(nets, state):
  return collect_attentions(state["intermediates"], nets.ami_layers) if nets.ami_layers else None


def interleave_views(view1: dict, view2: dict) -> dict:
  """Rows `[v1_0, v2_0, v1_1, v2_1, ...]` (`stack(..., 1).reshape(2B, ...)`), not `[view1; view2]`.

  A device that holds sentences i..j of the batch-sharded input holds both views of exactly
  those sentences, so stacking and splitting the views moves no activation between devices;
  and row 2i+v is the same whatever the batch's padded size (per-row random draws too).
  """
  return {k: jnp.stack([view1[k], view2[k]], axis=1).reshape(-1, *view1[k].shape[1:]) for k in TOKEN_KEYS}


def split_views(x: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
  """Inverse of `interleave_views` along `axis` (size 2B): the two `[..., B, ...]` views."""
  pairs = x.reshape(*x.shape[:axis], x.shape[axis] // 2, 2, *x.shape[axis + 1:])
  return jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)


def encode_stacked(params, view1, view2, key, nets) -> Encoded:
  """One forward pass of both views, interleaved per sentence, through the online encoder
  (independent dropout per row)."""
  both = interleave_views(view1, view2)
  out, state = nets.online.apply({"params": params["encoder"]}, *token_args(both), deterministic=False,
                                 rngs={"dropout": key}, mutable=["intermediates"])
  h1, h2 = split_views(out.last_hidden_state)
  att = _attention(nets, state)
  att1, att2 = split_views(att, axis=1) if att is not None else (None, None)
  return Encoded(h1, h2, att1, att2)


def encode_cross(params, view1, view2, key, nets) -> Encoded:
  """Contrastive Tension (Carlsson et al., ICLR 2021): view 1 by the online encoder, view 2 by
  the second, independently updated encoder `encoder_b`; the positive pairs run across them."""
  k1, k2 = jax.random.split(key)
  outs = [nets.online.apply({"params": params[name]}, *token_args(view), deterministic=False,
                            rngs={"dropout": k}, mutable=["intermediates"])
          for name, view, k in (("encoder", view1, k1), ("encoder_b", view2, k2))]
  (o1, s1), (o2, s2) = outs
  return Encoded(o1.last_hidden_state, o2.last_hidden_state, _attention(nets, s1), _attention(nets, s2))


def encode_views(config) -> Callable:
  return encode_cross if config.ct.enabled else encode_stacked
