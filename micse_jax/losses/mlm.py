"""Masked-language-model loss, the auxiliary term of SimCSE's `do_mlm` (used by ADD, InforMin-CL).

L_MLM = - sum_i w_i log p(label_i | corrupted input) / sum_i w_i,

the cross-entropy of BERT's MLM head at the selected positions (Devlin et al.
2019, Sec. 3.1), averaged over all selected tokens of the batch as PyTorch's
`CrossEntropyLoss(ignore_index=-100)` does in the public SimCSE/miCSE code. The
total objective adds beta * L_MLM (SimCSE `--mlm_weight`, default 0.1).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def mlm_loss(logits: jax.Array, labels: jax.Array, weights: jax.Array, total: jax.Array | None = None) -> jax.Array:
  """Weighted mean token cross-entropy, in float32 (at least).

  Args:
    logits: `[B, T, V]` MLM-head scores (any float dtype; upcast to float32).
    labels: `[B, T]` int target ids (the original tokens).
    weights: `[B, T]`, 1.0 at the positions to predict, 0.0 elsewhere.
    total: the batch's Σ weights when these are a block of its rows: the block's share of the
      batch's loss (adding up over the blocks to it); None: Σ `weights`.

  Returns:
    Scalar loss; 0.0 when no position is selected (PyTorch would give NaN).
  """
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  weights = weights.astype(logits.dtype)
  # Unselected rows are zeroed before the softmax, so whatever they hold reaches
  # neither the value nor the gradient.
  logits = jnp.where(weights[..., None] > 0, logits, 0.0)
  per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return jnp.sum(weights * per_token) / jnp.maximum(jnp.sum(weights) if total is None else total, 1.0)
