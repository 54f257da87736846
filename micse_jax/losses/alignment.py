"""Alignment and uniformity (Wang & Isola 2020, Sec. 4.1) and the positive-only objective
(miCSE Tab. 4 / App. E).

* alignment: E_{(x, y) positive} || f(x) - f(y) ||_2^alpha  on unit vectors;
* uniformity: log E_{x, y i.i.d.} exp(-t || f(x) - f(y) ||_2^2), estimated over
  the distinct pairs of a batch;
* positive-only: contrastive training with the negatives taken out, so only
  the pull between the two views of a sentence remains (miCSE App. E), the
  setting where AMI's regularisation shows most.

Lower is better for both metrics. They are analysis metrics (logged on a fixed
held-out slice); positive_only_loss is a training objective.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from micse_jax.losses.infonce import l2_normalize, row_mean

POSITIVE_ONLY_FORMS = ('diag_only', 'alignment')


def _unit(z: jax.Array) -> jax.Array:
  return l2_normalize(z.astype(jnp.promote_types(z.dtype, jnp.float32)))


def alignment(z1: jax.Array, z2: jax.Array, alpha: float = 2.0) -> jax.Array:
  """Wang & Isola L_align: mean over pairs of ||z1n - z2n||^alpha, z L2-normalised.

  Args:
    z1: `[N, D]` embeddings; row i is a positive pair with z2 row i.
    z2: `[N, D]`.
    alpha: the exponent (2 in Wang & Isola and SimCSE's analysis).
  """
  diff = _unit(z1) - _unit(z2)
  sq = jnp.sum(jnp.square(diff), axis=-1)
  return jnp.mean(sq ** (alpha / 2.0))


def uniformity(z: jax.Array, t: float = 2.0) -> jax.Array:
  """Wang & Isola L_uniform: log mean_{i<j} exp(-t ||zn_i - zn_j||^2), z L2-normalised.

  Computed with logsumexp over the N (N - 1) / 2 distinct pairs (N >= 2).
  """
  zn = _unit(z)
  n = zn.shape[0]
  if n < 2:
    raise ValueError(f'uniformity needs at least 2 embeddings, got {n}')
  # ||a - b||^2 = 2 - 2 a.b for unit vectors; clamp rounding below 0.
  sq = jnp.maximum(2.0 - 2.0 * zn @ zn.T, 0.0)
  i, j = jnp.triu_indices(n, k=1)
  return jax.nn.logsumexp(-t * sq[i, j]) - jnp.log(i.shape[0])


def positive_only_loss(z1: jax.Array, z2: jax.Array, temperature: float, *,
                       form: str = 'diag_only', row_mask: jax.Array | None = None) -> jax.Array:
  """Positive-only objective (miCSE Tab. 4, App. E): InfoNCE without negatives.

  Forms:
    * "diag_only" (default): the official miCSE code's `--diag_only` switch
      (SAP-samples/acl2023-micse, `model/models.py`): the cosine-similarity
      matrix keeps its diagonal and has its off-diagonal entries set to 0
      before the cross-entropy, so
          loss_i = log(1 + (B - 1) exp(-cos(z1_i, z2_i) / tau)),
      whose gradient only pulls the two views together (no push from
      negatives) and fades once they agree.
    * "alignment": the bare positive term of InfoNCE, mean_i -cos(z1_i, z2_i) / tau.

  Args:
    z1: `[B, D]` first-view embeddings.
    z2: `[B, D]` second-view embeddings.
    temperature: tau.
    form: "diag_only" or "alignment".
    row_mask: optional `[B]`, 0 for padding rows: left out of the mean and of B.
  """
  if form not in POSITIVE_ONLY_FORMS:
    raise ValueError(f'positive_only form must be one of {POSITIVE_ONLY_FORMS}, got {form!r}')
  cos = jnp.sum(_unit(z1) * _unit(z2), axis=-1)
  if form == 'alignment':
    return -row_mean(cos, row_mask) / temperature
  if row_mask is not None:  # B - 1 real others; log(0) = -inf gives the batch of one's 0
    others = jnp.sum(row_mask.astype(cos.dtype)) - 1.0
    return row_mean(jnp.logaddexp(0.0, jnp.log(others) - cos / temperature), row_mask)
  others = z1.shape[0] - 1
  if others == 0:  # a batch of one has no off-diagonal entries: CE of one logit is 0
    return jnp.zeros((), cos.dtype)
  # log(exp(c / tau) + (B - 1) exp(0)) - c / tau = log(1 + (B - 1) exp(-c / tau)), stably.
  return jnp.mean(jnp.logaddexp(0.0, jnp.log(float(others)) - cos / temperature))
