"""InforMin-CL's reconstruction term (Chen et al. 2022, "An Information Minimization Based
Contrastive Learning Model for Unsupervised Sentence Embeddings Learning", Eq. 8-9).

Each view's embedding should be recoverable from the other's, which with a
Gaussian decoder reduces to the squared distance between the two views,

    L_R = E_x || z1(x) - z2(x) ||^2                                  (Eq. 8-9),

and the objective is L = L_C + lambda * L_R (+ beta * L_MLM), lambda = 0.4 for
BERT-base in the paper.

Public-code form (ShaobinChen-AH/InforMin-CL, `informin-cl/models.py`): it
L2-normalises z1 and z2 first and computes `mse(z1, z2) + mse(z2, z1)`, i.e.
2 * mean over batch *and* dimensions of the squared difference. With unit
vectors ||z1 - z2||^2 = 2 - 2 cos, so the public term is (2 / D) * E||z1n - z2n||^2:
a lambda tuned for one form is off by a factor D / 2 (384 for BERT-base) in the
other. `normalize=True, public_scale=True` reproduces the public code; the
default is the paper's form.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from micse_jax.losses.infonce import l2_normalize, row_mean


def reconstruction_loss(z1: jax.Array, z2: jax.Array, *, normalize: bool = False,
                        public_scale: bool = False, row_mask: jax.Array | None = None) -> jax.Array:
  """InforMin-CL L_R (Eq. 8-9): mean over the batch of ||z1 - z2||^2.

  Args:
    z1: `[B, D]` embeddings of the first view.
    z2: `[B, D]` embeddings of the second view (same sentences).
    normalize: L2-normalise both first (as the public code does).
    public_scale: use the public code's reduction, 2 * mean over B and D,
      instead of the paper's sum over D and mean over B.
    row_mask: optional `[B]`, 0 for padding rows: left out of the mean.

  Returns:
    Scalar, float32 at least.
  """
  dtype = jnp.promote_types(z1.dtype, jnp.float32)
  z1, z2 = z1.astype(dtype), z2.astype(dtype)
  if normalize:
    z1, z2 = l2_normalize(z1), l2_normalize(z2)
  sq = jnp.square(z1 - z2)
  if public_scale:
    return 2.0 * row_mean(sq, row_mask)
  return row_mean(jnp.sum(sq, axis=-1), row_mask)
