"""InfoCSE's auxiliary MLM network (Wu et al., EMNLP 2022 Findings, §3.1 and Fig. 2).

The masked sentence is encoded by the lower half of the *frozen initial* encoder (the lower 6
of BERT-base's 12 layers); position 0 of those states is replaced by the online encoder's
final-layer [CLS] vector, and `num_layers` new transformer layers plus BERT's MLM head
predict the masked tokens. The decoder is tied to the frozen word embeddings, so the only
path from this loss to the trained encoder is the [CLS] vector: it must carry what the aux
network needs to reconstruct the sentence ("information aggregation").
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from micse_jax.models.bert import BertConfig, BertLayer, BertPredictionHeadTransform


def lower_half_layers(num_hidden_layers: int) -> int:
  """InfoCSE reads layer 6 of 12; shallower encoders use their lower half (at least 1)."""
  return 6 if num_hidden_layers >= 12 else max(1, num_hidden_layers // 2)


def frozen_lower_params(encoder_params: dict, num_layers: int) -> dict:
  """The embeddings and layers 0..num_layers-1 of an encoder's params (a copy)."""
  layers = {f"layer_{i}": encoder_params["encoder"][f"layer_{i}"] for i in range(num_layers)}
  return jax.tree.map(jnp.copy, {"embeddings": encoder_params["embeddings"], "encoder": layers})


class InfoCSEAuxiliary(nn.Module):
  """`num_layers` fresh BERT layers + the MLM head (`predictions/transform`, `predictions/bias`).

  Call with the lower-half hidden states `[B, T, H]` (position 0 already replaced by the
  online [CLS]), the attention mask and the (frozen) word-embedding matrix `[V, H]` the
  decoder is tied to; returns MLM logits `[B, T, V]`.
  """
  config: BertConfig
  num_layers: int = 2
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, hidden: jax.Array, attention_mask: jax.Array, word_embeddings: jax.Array,
               deterministic: bool = True) -> jax.Array:
    key_mask = attention_mask[:, None, None, :] > 0
    x = hidden.astype(self.dtype)
    for i in range(self.num_layers):
      x = BertLayer(self.config, dtype=self.dtype, name=f"layer_{i}")(x, key_mask, deterministic)
    return InfoCSEPredictions(self.config, self.dtype, name="predictions")(x, word_embeddings)


class InfoCSEPredictions(nn.Module):
  """BERT's `cls.predictions` with the decoder tied to an embedding matrix passed in."""
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, word_embeddings: jax.Array) -> jax.Array:
    x = BertPredictionHeadTransform(self.config, self.dtype, name="transform")(x)
    bias = self.param("bias", nn.initializers.zeros, (self.config.vocab_size,))
    return x @ word_embeddings.astype(self.dtype).T + bias.astype(self.dtype)
