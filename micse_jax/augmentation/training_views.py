"""The two views of a sentence, as small named functions the train step composes.

Token-level second views (`second_view`): the dropout view (SimCSE: the same tokens, another
dropout mask), the ADD view (Attention-Driven Dropout: the k least-attended tokens removed) and
the Mirror-BERT span-mask view. Encodings (`encode_views`): both views through the online
encoder in one stacked forward pass, or, for Contrastive Tension, view 1 through the online
encoder and view 2 through the second, independent encoder (positives across encoders).
The pure token functions live in `micse_jax/augmentation/`; this file wires them to the networks.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from micse_jax import augmentation
from micse_jax.augmentation.add import ADD_IMPORTANCE
from micse_jax.augmentation.dropout_views import two_dropout_views
from micse_jax.models.bert import collect_attentions
from micse_jax.tokenization import TOKEN_KEYS


def tokens_of(batch: dict) -> dict:
  """The `TOKEN_KEYS` entries of a batch (drops `sentence_ids` and the like)."""
  return {k: batch[k] for k in TOKEN_KEYS}


def token_args(batch: dict) -> tuple:
  """(input_ids, attention_mask, token_type_ids), the positional arguments of `BertModel`."""
  return tuple(batch[k] for k in TOKEN_KEYS)


def special_mask(batch: dict, nets) -> jax.Array:
  """True at [CLS], [SEP] and padding: the tokens no view may drop or mask."""
  t = nets.tokens
  return augmentation.special_token_mask(batch["input_ids"], batch["attention_mask"], t.cls_id, t.sep_id)


def dropout_view(params, batch, key, nets, config) -> dict:
  """SimCSE: view 2 is the same token sequence; only the dropout mask differs."""
  del params, key, nets, config
  return tokens_of(batch)


def span_mask_view(params, batch, key, nets, config) -> dict:
  """Mirror-BERT (Liu et al., EMNLP 2021, §2): one random span replaced by [MASK] in view 2."""
  del params
  ids = augmentation.span_mask(key, batch["input_ids"], batch["attention_mask"], special_mask(batch, nets),
                           span_length=config.view.span_length, mask_token_id=nets.tokens.mask_id)
  return dict(tokens_of(batch), input_ids=ids)


def add_view(params, batch, key, nets, config) -> dict:
  """Attention-Driven Dropout: view 2 drops the k least-attended droppable tokens.

  Importance comes from the current encoder's attention in a forward pass without dropout and
  without gradient (naive: attention received; rollout: Abnar & Zuidema), see `augmentation/add.py`.
  """
  del key
  v = config.view
  tokens = tokens_of(batch)
  _, state = nets.importance.apply({"params": params["encoder"]}, *token_args(tokens), deterministic=True,
                                   mutable=["intermediates"])
  layers = tuple(range(nets.importance.config.num_hidden_layers))
  att = jax.lax.stop_gradient(collect_attentions(state["intermediates"], layers).astype(jnp.float32))
  importance = ADD_IMPORTANCE[v.add_importance](att, batch["attention_mask"])
  num_drop = augmentation.num_tokens_to_drop(batch["attention_mask"].sum(axis=1), mode=v.add_mode,
                                         k=v.add_k, threshold=v.add_threshold)
  return augmentation.drop_least_attended(tokens, importance, num_drop, special_mask(batch, nets))


# The second view of each `view.kind` (`configs/methods.VIEW_KINDS`, the choices the checks read).
SECOND_VIEWS: dict[str, Callable] = {"dropout": dropout_view, "add": add_view, "span_mask": span_mask_view}


class Encoded(NamedTuple):
  """Both views' final hidden states `[B, T, H]` and sown attention `[L, B, H, T, T]` (or None)."""
  hidden1: jax.Array
  hidden2: jax.Array
  att1: jax.Array | None
  att2: jax.Array | None


def _attention(nets, state):
  return collect_attentions(state["intermediates"], nets.ami_layers) if nets.ami_layers else None


def encode_stacked(params, view1, view2, key, nets) -> Encoded:
  """One forward pass of both views, interleaved per sentence, through the online encoder
  (independent dropout per row)."""
  return Encoded(*two_dropout_views(nets.online, params["encoder"], view1, view2, key))


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
  """The encoding of the config's method: CT's two encoders, else one stacked forward."""
  return encode_cross if config.ct.enabled else encode_stacked
