"""InfoNCE over two dropout views with optional queue negatives (miCSE Eq. 2).

The SimCSE unsupervised objective that miCSE keeps as its first term: for anchor
z1[i] the positive is z2[i] (the same sentence under a second dropout mask), the
negatives are the other sentences' second views z2[j != i] and, optionally, the
entries of a negative queue filled by a momentum encoder. Logits are cosine
similarities divided by the temperature tau; the loss is the mean cross-entropy
of each row with label i.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

# Logit given to queue slots that hold no embedding yet. exp(_MASKED - max) is an
# exact 0 in float32 because real logits are bounded by 1 / temperature.
_MASKED_LOGIT = -1e9
_NORM_EPS = 1e-8


def _compute_dtype(x: jax.Array) -> jnp.dtype:
  """float32, or wider when the input already is (float64 in tests)."""
  return jnp.promote_types(x.dtype, jnp.float32)


def l2_normalize(x: jax.Array, eps: float = _NORM_EPS) -> jax.Array:
  """Scales the rows of `x` to unit norm; an all-zero row stays zero (no NaN)."""
  sq_norm = jnp.sum(jnp.square(x), axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(sq_norm, eps * eps))


def _queue_logits(z1n: jax.Array, queue: jax.Array, queue_valid: Optional[jax.Array],
                  temperature: float) -> jax.Array:
  """cos(z1_i, q_k) / tau as extra columns; unfilled slots get a huge negative logit.

  Invalid rows are zeroed *before* the matmul, so garbage there (even NaN or inf)
  reaches neither the loss nor any gradient.
  """
  queue = queue.astype(_compute_dtype(z1n))
  if queue_valid is None:
    return z1n @ l2_normalize(queue).T / temperature
  valid = queue_valid.astype(bool)
  queue = jnp.where(valid[:, None], queue, 0.0)
  logits = z1n @ l2_normalize(queue).T / temperature
  return jnp.where(valid[None, :], logits, _MASKED_LOGIT)


def info_nce_loss(z1: jax.Array, z2: jax.Array, queue: Optional[jax.Array] = None,
                  queue_valid: Optional[jax.Array] = None,
                  temperature: float = 0.05) -> tuple[jax.Array, dict[str, jax.Array]]:
  """SimCSE / miCSE InfoNCE loss (miCSE Eq. 2), optionally with queue negatives.

  loss = -1/B sum_i log( exp(s(z1_i, z2_i)/tau) /
                         (sum_j exp(s(z1_i, z2_j)/tau) + sum_k exp(s(z1_i, q_k)/tau)) ),
  with s the cosine similarity. Computed in float32 (or wider) whatever the input dtype.

  Args:
    z1: `[B, D]` embeddings of the first dropout view (anchors).
    z2: `[B, D]` embeddings of the second view; z2[i] is the positive of z1[i].
    queue: optional `[Q, D]` extra negatives (e.g. momentum-encoder embeddings).
    queue_valid: optional `[Q]` bool, False for slots not filled yet; those slots
      contribute nothing. None means every queue slot is valid.
    temperature: softmax temperature tau.

  Returns:
    (loss, metrics) with metrics `infonce` (the loss), `pos_cos` (mean positive
    cosine), `neg_cos` (mean in-batch negative cosine; 0 when B == 1) and `acc`
    (fraction of rows whose positive has the largest logit).
  """
  dtype = _compute_dtype(z1)
  z1n = l2_normalize(z1.astype(dtype))
  z2n = l2_normalize(z2.astype(dtype))
  cos = z1n @ z2n.T  # [B, B]
  logits = cos / temperature
  if queue is not None:
    logits = jnp.concatenate(
        [logits, _queue_logits(z1n, queue, queue_valid, temperature)], axis=1)
  batch = cos.shape[0]
  labels = jnp.arange(batch)
  pos_logit = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
  loss = jnp.mean(jax.nn.logsumexp(logits, axis=1) - pos_logit)
  pos_cos = jnp.diagonal(cos)
  off_diag = max(batch * (batch - 1), 1)
  metrics = {
      'infonce': loss,
      'pos_cos': jnp.mean(pos_cos),
      'neg_cos': (jnp.sum(cos) - jnp.sum(pos_cos)) / off_diag,
      'acc': jnp.mean((jnp.argmax(logits, axis=1) == labels).astype(jnp.float32)),
  }
  return loss, metrics
