"""InfoCSE (Wu et al., EMNLP 2022 Findings) in one place: its auxiliary MLM network, the frozen
lower half it reads, its parameters, its loss term and its pre-training phase.

| InfoCSE | paper | here |
| --- | --- | --- |
| the masked sentence through the lower half of the *frozen initial* encoder | §3.1, Fig. 2 | `lower_half_layers`, `frozen_lower_params` |
| position 0 replaced by the online [CLS]; `num_layers` fresh layers + BERT's MLM head | §3.1, Fig. 2 | `InfoCSEAuxiliary` |
| λ·L_MLM added to SimCSE's loss | Eq. 5 | `infocse_term` |
| first train the auxiliary network alone | §3.1 (two-stage training) | `add_to_loss` |
| its modules and parameters (frozen: `infocse_lower`; trained: `infocse`) | | `build_networks`, `initial_params` |

The decoder is tied to the frozen word embeddings, so the only path from this loss to the
trained encoder is the [CLS] vector: it must carry what the auxiliary network needs to rebuild
the sentence ("information aggregation"). The config fields are `config.infocse.*`
(`configs/infocse.py`); their checks are in `config_checks.py`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from micse_jax.losses.mlm import mlm_loss
from micse_jax.models.bert import BertConfig, BertLayer, BertModel, BertPredictionHeadTransform
from micse_jax.models.embed import whole_on
from micse_jax.models.policy import Policy
from micse_jax.training.terms import masked_copy

FROZEN_KEY = "infocse_lower"   # the frozen lower half in `TrainState.frozen_params`
PARAMS_KEY = "infocse"         # the auxiliary network in `TrainState.params`


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
  policy: Policy = Policy()

  @nn.compact
  def __call__(self, hidden: jax.Array, attention_mask: jax.Array, word_embeddings: jax.Array,
               deterministic: bool = True) -> jax.Array:
    key_mask = attention_mask[:, None, None, :] > 0
    x = hidden.astype(self.dtype)
    with self.policy.applied():  # the policy its layers read (models/policy.py)
      for i in range(self.num_layers):
        x = BertLayer(config=self.config, dtype=self.dtype, policy=self.policy, name=f"layer_{i}")(x, key_mask,
                                                                                                  deterministic)
      return InfoCSEPredictions(config=self.config, dtype=self.dtype, name="predictions")(x, word_embeddings)


class InfoCSEPredictions(nn.Module):
  """BERT's `cls.predictions` with the decoder tied to an embedding matrix passed in."""
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, word_embeddings: jax.Array) -> jax.Array:
    x = BertPredictionHeadTransform(self.config, self.dtype, name="transform")(x)
    bias = self.param("bias", nn.initializers.zeros, (self.config.vocab_size,))
    return x @ word_embeddings.astype(self.dtype).T + bias.astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class InfoCSENetworks:
  """The frozen lower half (a shallower `BertModel`) and the auxiliary network."""
  lower: BertModel
  auxiliary: InfoCSEAuxiliary


def build_networks(config, bert_config: BertConfig, options: dict) -> InfoCSENetworks:
  """The two modules for `bert_config` (`options`: the `BertModel` dtype and policy keywords)."""
  lower = bert_config.replace(num_hidden_layers=lower_half_layers(bert_config.num_hidden_layers))
  return InfoCSENetworks(lower=BertModel(lower, add_pooler=False, **options),
                         auxiliary=InfoCSEAuxiliary(bert_config, config.infocse.num_layers, **options))


def initial_params(nets: InfoCSENetworks, encoder_params: dict, mlm_head: dict, seed: int) -> tuple[dict, dict]:
  """(trained auxiliary params: fresh layers + the checkpoint's MLM head, frozen lower half)."""
  config = nets.auxiliary.config
  frozen = frozen_lower_params(encoder_params, nets.lower.config.num_hidden_layers)
  dummy = (jnp.zeros((1, 2, config.hidden_size)), jnp.ones((1, 2), jnp.int32),
           jnp.zeros((config.vocab_size, config.hidden_size)))
  auxiliary = nets.auxiliary.init(jax.random.PRNGKey(seed + 1), *dummy)["params"]
  auxiliary = dict(auxiliary, predictions=jax.tree.map(jnp.copy, mlm_head["predictions"]))
  return auxiliary, frozen


def infocse_term(params, frozen, batch, cls_vector, key, nets, config, weight=None, copy=None, total=None):
  """λ·L_MLM (Eq. 5): the auxiliary network predicts the masked tokens from the frozen lower
  half's states with position 0 replaced by the online [CLS] (`cls_vector`, with gradient).

  The frozen states and the tied decoder embeddings are `stop_gradient`-ed and come from
  `frozen` (not `params`), so the trained encoder gets gradient only through `cls_vector`. `copy` and
  `total`: a block of a batch's rows, as `terms.mlm_term`'s.
  """
  k_mask, k_drop = jax.random.split(key)
  masked_ids, labels, weights = copy if copy is not None else masked_copy(batch, k_mask, nets, config.infocse.mask_prob)
  lower = frozen[FROZEN_KEY]
  out = nets.infocse.lower.apply({"params": lower}, masked_ids, batch["attention_mask"],
                                 batch["token_type_ids"], deterministic=True)
  hidden = jax.lax.stop_gradient(out.last_hidden_state)
  hidden = hidden.at[:, 0].set(cls_vector.astype(hidden.dtype))
  table = lower["embeddings"]["word_embeddings"]["embedding"]  # whole: the FSDP gather leaves tables to their users
  embeddings = jax.lax.stop_gradient(whole_on(table, nets.infocse.lower.policy.table_mesh))
  logits = nets.infocse.auxiliary.apply({"params": params[PARAMS_KEY]}, hidden, batch["attention_mask"],
                                        embeddings, deterministic=False, rngs={"dropout": k_drop})
  loss = mlm_loss(logits, labels, weights, total)
  weight = config.infocse.weight if weight is None else weight
  return weight * loss, {"infocse_mlm": loss}


def add_to_loss(loss, metrics, params, frozen, batch, online_cls, key, step, nets, config):
  """The step's loss with InfoCSE's term added, and its metrics.

  Pre-training (§3.1): while `step < infocse.pretrain_steps` only the auxiliary network is
  trained: the loss is L_MLM alone and no gradient reaches the encoder through [CLS].
  """
  pretraining = step < config.infocse.pretrain_steps
  cls = jnp.where(pretraining, jax.lax.stop_gradient(online_cls), online_cls)
  term, term_metrics = infocse_term(params, frozen, batch, cls, key, nets, config)
  return jnp.where(pretraining, term_metrics["infocse_mlm"], loss + term), dict(metrics, **term_metrics)
