"""Sentence poolers used by SimCSE/miCSE evaluation (SimCSE `Pooler`, Gao et al. 2021)."""
import jax
import jax.numpy as jnp

POOLERS = ("cls_before_pooler", "cls", "avg")


def cls_before_pooler(last_hidden: jax.Array) -> jax.Array:
  """Raw [CLS] hidden state: the evaluation pooler of SimCSE/miCSE."""
  return last_hidden[:, 0]


def masked_mean(last_hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
  """`avg`: mean of the hidden states of real (non-padding) tokens."""
  mask = attention_mask[..., None].astype(last_hidden.dtype)
  return (last_hidden * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1)


def check_pooler(name: str) -> str:
  """Returns `name` when it is one of `POOLERS`, else raises ValueError."""
  if name not in POOLERS:
    raise ValueError(f"unknown pooler {name!r}; expected one of {', '.join(POOLERS)}")
  return name
