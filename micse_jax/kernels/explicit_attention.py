"""The explicit attention path: softmax(QKᵀ/√d + mask) and its context as plain XLA ops (Vaswani et
al. 2017, Eq. 1), HF BERT's arithmetic. It is the path of layers whose probabilities are read (AMI
sows them; dropout drops them) and the reference every faster path of `kernels/choice.py` equals.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def probabilities(q, k, key_mask):
  """softmax(QKᵀ/√d + mask), float32, `[B, heads, T, T]` from `[B, heads, T, d]` q and k: the scores
  in their dtype (HF's matmul), padded keys (`key_mask` false or 0, broadcastable to the scores) set
  to float32's minimum (HF's extended mask), so they get exactly zero probability."""
  scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
  scores = jnp.where(key_mask != 0, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(scores, axis=-1)


def context(probs, v):
  """The context `[B, T, heads·d]`: the probabilities `[B, heads, T', T]` times `[B, heads, T, d]` v,
  heads folded back into the hidden axis."""
  ctx = jnp.einsum("bhqk,bhkd->bhqd", probs, v).transpose(0, 2, 1, 3)
  return ctx.reshape(ctx.shape[:2] + (-1,))
