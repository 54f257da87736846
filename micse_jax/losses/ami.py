"""Attention mutual information, AMI (miCSE Sec. 2.2, Alg. 1, Eq. 3-5).

miCSE aligns the attention patterns of the two dropout views of a sentence. The
attention probabilities of a *slice* (a group of heads of one layer by default)
are treated as samples of a log-normal variable: their logs are modelled as
jointly Gaussian across the two views, so the mutual information of the views
is a function of the Pearson correlation rho of the log-values alone,

    I(X; Y) = -1/2 log(1 - rho^2)                                  (Eq. 4),

estimated per (sentence, slice) from `num_samples` cells drawn uniformly
without replacement, with the same draw for both views (Alg. 1). The training
loss adds -lambda * mean I to InfoNCE (Eq. 5), so minimizing it maximizes the
agreement of the two views' attention.

Two variants (`ami.variant`; `AMI_VARIANTS`), one function each:

* "paper" (`ami_loss`, the default): Alg. 1 as written. Slices are (layer, group of heads);
  cells are (real query, real key) pairs, optionally only those > 0 in both
  views; a (sentence, slice) pair counts when it has >= `min_valid` valid
  samples; loss = -lambda * mean MI.
* "official" (`losses/ami_official.py`: `official_ami_loss`): what SAP-samples/acl2023-micse (`model/models.py`, `cl_forward`)
  computes. It differs from the paper variant in four ways:
  1. slicing: one slice per (sentence, head, layer parity), pooling the chosen
     layers of equal parity (`fold_layer_parity`, `heads_per_slice=1`,
     `pool_layers=True`); the public recipe takes layers 7-10 (0-based,
     `--min_layer 7 --max_layer 11`);
  2. validity: a cell is valid when it is > 0 in both views. Padding is *not*
     masked: padding query rows attend to real keys and count, and only the
     padding keys drop out (their probability is exactly 0);
  3. a slice with fewer than m = `num_samples` valid cells is dropped. If no
     slice of the batch reaches m, every slice is kept and m is lowered to the
     smallest valid count of the batch (m = 0: no AMI term that step);
  4. the term is multiplied by (fraction of valid cells)^2 + 1e-6, the
     fraction taken over all cells of the kept slices (a constant of the step,
     no gradient). The fraction is about (mean real-key share of the padded
     length) x (1 - attention dropout)^2, so it depends on padding and
     dropout. lambda = 2.5e-3 was tuned with this factor: at a typical factor
     of about 0.4 the same lambda weighs the paper variant roughly 2.5x more.
  Kept from the paper variant: rho^2 is clamped to <= 1 - rho2_eps (the public
  code would produce an infinite loss for identical views) and a slice with a
  constant view contributes MI 0 (the public code's cosine with eps 1e-6 gives
  0 as well).

Everything below has static shapes and is jit-able. The biggest arrays are of
the size of the attention tensors themselves (the sliced copies, the validity
mask and the Gumbel noise); the samples are `[B, S, m]`.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from micse_jax.losses.ami_cells import (  # noqa: F401 (re-exported: the cells of Alg. 1)
  all_rows_here,
  cell_validity,
  fold_layer_parity,
  row_gumbel_noise,
  sample_cells,
  slice_attention,
  top_k_cells,
)

# Sums of squared log-deviations at or below this count as a constant view
# (undefined rho); float32 rounding of a constant slice stays far below it.
_MIN_VAR = 1e-10


class AMIResult(NamedTuple):
  """Per-(sentence, slice) output of `attention_mutual_information`.

  Attributes:
    mi: `[B, S]` Gaussian mutual information -1/2 log(1 - rho^2) (Eq. 4).
    rho: `[B, S]` weighted Pearson correlation of the two views' log-values.
    weight: `[B, S]` 1.0 where the pair had at least `min_valid` valid samples
      and non-constant log-values in both views, else 0.0; means over pairs
      use it.
    num_valid: `[B, S]` number of valid cells among the samples.
    indices: `[B, S, m]` sampled flat cell indices (the same for both views).
    sample_weight: `[B, S, m]` 1.0 for samples that landed on a valid cell.
  """
  mi: jax.Array
  rho: jax.Array
  weight: jax.Array
  num_valid: jax.Array
  indices: jax.Array
  sample_weight: jax.Array


def safe_log(x: jax.Array, sample_weight: jax.Array, eps: float) -> jax.Array:
  """log(max(x, eps)) on weighted samples, 0 elsewhere; finite values and gradients.

  Zero-weight slots are replaced by 1 *before* the log, so whatever they hold
  (0, or even NaN) reaches neither the value nor the gradient.
  """
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  keep = sample_weight > 0
  logs = jnp.log(jnp.maximum(jnp.where(keep, x, 1.0), eps))
  return jnp.where(keep, logs, 0.0)


def weighted_pearson(u: jax.Array, v: jax.Array,
                     w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Weighted Pearson correlation over the last axis (the rho of Eq. 4).

  rho = sum w du dv / sqrt(sum w du^2 * sum w dv^2), du = u - (sum w u / sum w).

  Returns:
    (rho, defined): `defined` is False where a view has (numerically) zero
    weighted variance: no weight, or constant values. rho is 0 there, and the
    variances are swapped for 1 before the rsqrt so that no inf/NaN appears in
    the gradient either.
  """
  total = jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1e-12)
  du = u - jnp.sum(w * u, axis=-1, keepdims=True) / total
  dv = v - jnp.sum(w * v, axis=-1, keepdims=True) / total
  cov = jnp.sum(w * du * dv, axis=-1)
  var_u = jnp.sum(w * du * du, axis=-1)
  var_v = jnp.sum(w * dv * dv, axis=-1)
  defined = (var_u > _MIN_VAR) & (var_v > _MIN_VAR)
  safe_u = jnp.where(defined, var_u, 1.0)
  safe_v = jnp.where(defined, var_v, 1.0)
  rho = cov * jax.lax.rsqrt(safe_u) * jax.lax.rsqrt(safe_v)
  return jnp.where(defined, jnp.clip(rho, -1.0, 1.0), 0.0), defined


def gaussian_mi(rho: jax.Array, rho2_eps: float = 1e-4) -> jax.Array:
  """I = -1/2 log(1 - rho^2) (Eq. 4), with rho^2 clamped to <= 1 - rho2_eps."""
  return -0.5 * jnp.log1p(-jnp.minimum(jnp.square(rho), 1.0 - rho2_eps))


def mi_from_samples(x1: jax.Array, x2: jax.Array, sample_weight: jax.Array, *,
                    log_eps: float = 1e-12, rho2_eps: float = 1e-4,
                    min_valid: int = 3) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Deterministic core of AMI on already sampled attention values (Eq. 3-4).

  Args:
    x1: `[..., m]` sampled probabilities of view 1.
    x2: `[..., m]` the same cells in view 2.
    sample_weight: `[..., m]` 1.0 for valid samples, 0.0 for padding picks.
    log_eps: values below it are clamped before the log.
    rho2_eps: rho^2 is clamped to <= 1 - rho2_eps.
    min_valid: pairs with fewer valid samples get weight 0 (as do pairs where
      a view is constant, whose rho is undefined).

  Returns:
    (mi, rho, pair_weight, num_valid), each `[...]`.
  """
  w = sample_weight.astype(jnp.float32)
  u = safe_log(x1, w, log_eps)
  v = safe_log(x2, w, log_eps)
  rho, defined = weighted_pearson(u, v, w)
  num_valid = jnp.sum(w, axis=-1)
  pair_weight = ((num_valid >= min_valid) & defined).astype(jnp.float32)
  rho = rho * pair_weight
  return gaussian_mi(rho, rho2_eps), rho, pair_weight, num_valid


def attention_mutual_information(att1: jax.Array, att2: jax.Array,
                                 attention_mask: jax.Array, rng: jax.Array, *,
                                 num_samples: int = 150, heads_per_slice: int = 2,
                                 pool_layers: bool = False, require_positive: bool = True,
                                 log_eps: float = 1e-12, rho2_eps: float = 1e-4,
                                 min_valid: int = 3, row_mask: jax.Array | None = None,
                                 map_rows: Callable = all_rows_here,
                                 row_ids: jax.Array | None = None,
                                 samples: tuple[jax.Array, jax.Array] | None = None) -> AMIResult:
  """Per-(sentence, slice) AMI between two views' attention (Alg. 1, Eq. 3-4).

  Args:
    att1: `[L, B, H, T, T]` post-softmax, post-dropout attention of view 1.
    att2: the same for view 2 (same sentences, another dropout mask).
    attention_mask: `[B, T]`, 1 for real tokens.
    rng: PRNG key for the cell sampling (sentence b samples with `fold_in(rng, b)`).
    num_samples: cells sampled per (sentence, slice), capped at the slice size.
    heads_per_slice: adjacent heads pooled into one slice.
    pool_layers: pool all given layers of a head group into one slice.
    require_positive: only sample cells that are > 0 in both views.
    log_eps: clamp before the log (matters when require_positive is False).
    rho2_eps: rho^2 is clamped to <= 1 - rho2_eps, capping the MI.
    min_valid: (sentence, slice) pairs with fewer valid samples get weight 0.
    row_mask: optional `[B]`, 0 for padding rows of the batch: their pairs get weight 0.
    map_rows: how the per-sentence work (sampling, gathering the samples, the MI) runs over
      the rows; `all_rows_here` on one device, `shard_map` per device on a mesh.
    row_ids: `[B]` the rows' indices in the whole batch (their sampling keys); `arange(B)` when
      None, other indices for a block of a batch's rows (`models/row_block.py`).
    samples: (indices, sample_weight) `[B, S, m]` of an earlier call on the same maps (the same
      draw): the cells are taken from there, not sampled again (`rng` and `row_ids` unused).

  Returns:
    An `AMIResult` of `[B, S]` arrays (and the `[B, S, m]` samples).
  """
  slices1 = slice_attention(att1, heads_per_slice, pool_layers)
  slices2 = slice_attention(att2, heads_per_slice, pool_layers)
  mi_of = lambda x1, x2, w: mi_from_samples(x1, x2, w, log_eps=log_eps, rho2_eps=rho2_eps, min_valid=min_valid)

  def per_sentence(valid, slices1, slices2, row_ids, rng):
    indices, sample_weight = top_k_cells(valid, row_gumbel_noise(rng, row_ids, valid.shape[1:]), num_samples)
    x1, x2 = (jnp.take_along_axis(x, indices, -1) for x in (slices1, slices2))
    return *mi_of(x1, x2, sample_weight), indices, sample_weight

  def per_sentence_sampled(slices1, slices2, indices, sample_weight):
    x1, x2 = (jnp.take_along_axis(x, indices, -1) for x in (slices1, slices2))
    return *mi_of(x1, x2, sample_weight), indices, sample_weight

  if samples is not None:
    mi, rho, weight, num_valid, indices, sample_weight = map_rows(
        per_sentence_sampled, (slices1, slices2, *samples), ())
  else:
    valid = cell_validity(att1, att2, attention_mask, heads_per_slice=heads_per_slice,
                          pool_layers=pool_layers, require_positive=require_positive)
    mi, rho, weight, num_valid, indices, sample_weight = map_rows(
        per_sentence, (valid, slices1, slices2, batch_row_ids(row_ids, valid.shape[0])), (rng,))
  if row_mask is not None:
    weight = weight * row_mask.astype(weight.dtype)[:, None]
  return AMIResult(mi, rho, weight, num_valid, indices, sample_weight)


def batch_row_ids(row_ids: jax.Array | None, rows: int) -> jax.Array:
  """The rows' indices in the batch (their sampling keys): `row_ids`, or `arange(rows)` when None."""
  return jnp.arange(rows, dtype=jnp.int32) if row_ids is None else row_ids.astype(jnp.int32)


def weighted_mean(x: jax.Array, w: jax.Array, total: jax.Array | None = None) -> jax.Array:
  """Σ w·x / max(Σ w, 1); with `total`, Σ w·x / max(total, 1): a block's share of the batch's mean."""
  return jnp.sum(w * x) / jnp.maximum(jnp.sum(w) if total is None else total, 1.0)


def _real_row_mean(x: jax.Array, row_mask: jax.Array | None) -> jax.Array:
  """Mean of `[B, S]` values over the real rows (all rows when `row_mask` is None)."""
  if row_mask is None:
    return jnp.mean(x)
  rows = jnp.broadcast_to(row_mask.astype(x.dtype)[:, None], x.shape)
  return weighted_mean(x, rows)


AMI_VARIANTS = ('paper', 'official')  # `ami.variant`: `ami_loss`, `ami_official.official_ami_loss`
class Totals(NamedTuple):
  """The whole batch's denominators, given to a block of its rows (`models/row_block.py`) so that the
  block's term and metrics are its shares of the batch's, which add up over the blocks to them:
  `pairs`, Σ of the (sentence, slice) weights; `rows`, the real rows."""
  pairs: jax.Array
  rows: jax.Array


def row_share(weight: jax.Array, row_mask: jax.Array | None, rows: jax.Array | None) -> jax.Array:
  """The fraction of the batch's (real row, slice) pairs that count: Σ w / (real rows · S), or the
  block's share of it with the batch's `rows`."""
  if rows is None:
    return _real_row_mean(weight, row_mask)
  return jnp.sum(weight) / jnp.maximum(rows * weight.shape[-1], 1.0)


def ami_loss(att1: jax.Array, att2: jax.Array, attention_mask: jax.Array, rng: jax.Array, *,
             weight: float = 2.5e-3, num_samples: int = 150, heads_per_slice: int = 2,
             pool_layers: bool = False, require_positive: bool = True,
             log_eps: float = 1e-12, rho2_eps: float = 1e-4,
             min_valid: int = 3, row_mask: jax.Array | None = None,
             map_rows: Callable = all_rows_here, row_ids: jax.Array | None = None,
             totals: Totals | None = None,
             samples: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """AMI term of the miCSE objective (Eq. 5), the paper's variant: loss = -weight * mean MI.

  The mean runs over (sentence, slice) pairs with at least `min_valid` valid samples (0 when
  there are none). Arguments as in `attention_mutual_information`; `weight` is lambda of
  Eq. 5. The official code's variant is `official_ami_loss`.

  `row_mask` (`[B]`, 0 for the padding rows of a padded batch) leaves those rows out of the
  term and of every metric; `map_rows` runs the per-sentence work per device (see
  `attention_mutual_information`). For a block of a batch's rows, `row_ids` are the rows' indices in
  the batch and `totals` the batch's denominators: the loss and metrics are the block's shares;
  `samples`: the cells an earlier call drew (`attention_mutual_information`).

  Returns:
    (loss, metrics) with metrics `ami` (the loss), `ami_mi` (mean MI), `ami_rho`
    (mean rho), `ami_pairs` (fraction of pairs that counted) and `ami_samples`
    (mean valid samples per counted pair).
  """
  res = attention_mutual_information(
      att1, att2, attention_mask, rng, num_samples=num_samples,
      heads_per_slice=heads_per_slice, pool_layers=pool_layers,
      require_positive=require_positive, log_eps=log_eps, rho2_eps=rho2_eps,
      min_valid=min_valid, row_mask=row_mask, map_rows=map_rows, row_ids=row_ids, samples=samples)
  pairs = None if totals is None else totals.pairs
  mean_mi = weighted_mean(res.mi, res.weight, pairs)
  loss = -weight * mean_mi
  metrics = {
      'ami': loss,
      'ami_mi': mean_mi,
      'ami_rho': weighted_mean(res.rho, res.weight, pairs),
      'ami_pairs': row_share(res.weight, row_mask, None if totals is None else totals.rows),
      'ami_samples': weighted_mean(res.num_valid, res.weight, pairs),
  }
  return loss, metrics


def resolve_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
  """`ami.layers` as 0-based layer indices; negative ones count from the top (-1 = last layer).

  Raises ValueError for an empty list, an index outside the encoder, or a layer named twice.
  """
  if not layers or any(not -num_layers <= i < num_layers for i in layers):
    raise ValueError(f"ami.layers {tuple(layers)} invalid for a {num_layers}-layer encoder")
  resolved = sorted({i % num_layers for i in layers})
  if len(resolved) != len(layers):
    raise ValueError(f"ami.layers {tuple(layers)} name a layer twice")
  return tuple(resolved)
