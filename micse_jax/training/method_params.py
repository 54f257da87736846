"""Initial trainable and frozen parameters for each method (beyond encoder + MLP head).

params: `encoder`, `head` always; CT adds `encoder_b`, `head_b` (a second, independently
trained copy); the MLM auxiliary adds `mlm_head` (BERT's `cls` head, from the checkpoint);
InfoCSE adds `infocse` (fresh transformer layers + the checkpoint's MLM head). frozen:
InfoCSE's `infocse_lower` (embeddings + lower half of the *initial* encoder, never updated).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from micse_jax.models.infocse import frozen_lower_params, lower_half_layers

_copy = lambda tree: jax.tree.map(jnp.copy, tree)


def method_params(config, nets, encoder_params: dict, head_params: dict, seed: int) -> tuple[dict, dict]:
  """Returns (trainable params, frozen params). `encoder_params` may carry the `cls` MLM head."""
  encoder = dict(encoder_params)
  mlm_head = encoder.pop("cls", None)
  params, frozen = {"encoder": encoder, "head": head_params}, {}
  if config.ct.enabled:
    params["encoder_b"], params["head_b"] = _copy(encoder), _copy(head_params)
  if config.mlm.enabled:
    params["mlm_head"] = mlm_head
  if config.infocse.enabled:
    lower = frozen_lower_params(encoder, lower_half_layers(nets.online.config.num_hidden_layers))
    frozen["infocse_lower"] = lower
    hidden = nets.online.config.hidden_size
    dummy = jnp.zeros((1, 2, hidden)), jnp.ones((1, 2), jnp.int32), jnp.zeros((nets.online.config.vocab_size, hidden))
    aux = nets.infocse_aux.init(jax.random.PRNGKey(seed + 1), *dummy)["params"]
    aux = dict(aux, predictions=_copy(mlm_head["predictions"]))  # the checkpoint's MLM head
    params["infocse"] = aux
  return params, frozen
