"""Which positions of a tokenized batch are special tokens ([CLS], [SEP], ...).

MLM masking, span masking and Attention-Driven Dropout must leave these (and
padding) alone; this is the one place that decides which they are.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def special_token_mask(input_ids: jax.Array, attention_mask: jax.Array, cls_id: int,
                       sep_id: int, *, extra_ids: Sequence[int] = ()) -> jax.Array:
  """`[B, T]` bool: True at real (attention_mask = 1) positions holding a special token.

  Args:
    input_ids: `[B, T]` token ids.
    attention_mask: `[B, T]`, 1 for real tokens, 0 for padding.
    cls_id: id of [CLS] (`<s>` for RoBERTa).
    sep_id: id of [SEP] (`</s>` for RoBERTa).
    extra_ids: further ids to treat as special (e.g. [MASK], [UNK] if wanted).

  Padding positions are False here; callers that need "neither special nor
  padding" combine this with `attention_mask`.
  """
  ids = (cls_id, sep_id, *extra_ids)
  special = jnp.zeros(input_ids.shape, bool)
  for token in ids:
    special = special | (input_ids == token)
  return special & attention_mask.astype(bool)
