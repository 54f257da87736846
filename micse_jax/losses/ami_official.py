"""The AMI term as the official miCSE code computes it (the "official" variant of `losses/ami.py`, whose
module docstring lists how it differs from the paper's Alg. 1): slices (head, layer parity), cells valid
when > 0 in both views, a slice kept when it reaches m valid cells (else every slice with the batch's
smallest count), and the term scaled by (fraction of valid cells)² + 1e-6.

The batch-wide choices (which slices are kept, m, the scale) are `official_selection`, from each slice's
valid count; a block of a batch's rows (`models/row_block.py`) takes the batch's selection at its rows.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from micse_jax.losses.ami import (
  Totals,
  batch_row_ids,
  gaussian_mi,
  row_share,
  safe_log,
  weighted_mean,
  weighted_pearson,
)
from micse_jax.losses.ami_cells import all_rows_here, fold_layer_parity, row_gumbel_noise, slice_attention, top_k_cells

_OFFICIAL_SCALE_EPS = 1e-6


class OfficialAMIResult(NamedTuple):
  """Output of `official_attention_mutual_information`.

  Attributes:
    mi: `[B, S]` MI per (sentence, slice); 0 where the view is constant.
    rho: `[B, S]` Pearson correlation of the sampled log-values.
    weight: `[B, S]` 1.0 for the slices the official recipe keeps.
    num_valid: `[B, S]` valid (> 0 in both views) cells per slice.
    num_used: scalar int, samples per kept slice (m, or the batch's smallest
      count when no slice reaches m).
    scale: scalar, (fraction of valid cells over the kept slices)^2 + 1e-6.
    indices: `[B, S, m]` sampled cell indices (first `num_used` are used).
    sample_weight: `[B, S, m]` 1.0 for the samples that enter the MI.
  """
  mi: jax.Array
  rho: jax.Array
  weight: jax.Array
  num_valid: jax.Array
  num_used: jax.Array
  scale: jax.Array
  indices: jax.Array
  sample_weight: jax.Array


def official_attention_mutual_information(att1: jax.Array, att2: jax.Array, rng: jax.Array, *,
                                          num_samples: int = 150,
                                          rho2_eps: float = 1e-4,
                                          row_mask: jax.Array | None = None,
                                          map_rows: Callable = all_rows_here) -> OfficialAMIResult:
  """AMI as the official miCSE code computes it (see the module docstring, "official").

  Args:
    att1: `[L, B, H, T, T]` attention of view 1 on the chosen layers (L even;
      the public recipe uses layers 7-10).
    att2: the same for view 2.
    rng: PRNG key for the cell sampling (sentence b samples with `fold_in(rng, b)`).
    num_samples: m (150 in the public code).
    rho2_eps: rho^2 is clamped to <= 1 - rho2_eps.
    row_mask: optional `[B]`, 0 for padding rows: never kept, and left out of the batch's
      smallest count and of the valid-cell fraction.
    map_rows: see `attention_mutual_information`.

  Returns:
    An `OfficialAMIResult`; slices are (head, layer parity), `[B, 2H]`.
  """
  valid, x1, x2 = official_cells(att1, att2)
  selection = official_selection(jnp.sum(valid, axis=-1).astype(jnp.int32), row_mask, num_samples,
                                 valid.shape[-1])
  mi, rho, indices, sample_weight = official_mi(valid, x1, x2, selection, rng, num_samples=num_samples,
                                                rho2_eps=rho2_eps, map_rows=map_rows)
  return OfficialAMIResult(mi, rho, selection.weight, selection.num_valid, selection.num_used, selection.scale,
                           indices, sample_weight)


def official_cells(att1: jax.Array, att2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(valid `[B, S, C]`: > 0 in both views, view 1's and view 2's slices `[B, S, C]`) of the official
  slicing (head, layer parity); padding rows are not masked."""
  x1 = slice_attention(fold_layer_parity(att1), heads_per_slice=1, pool_layers=True)
  x2 = slice_attention(fold_layer_parity(att2), heads_per_slice=1, pool_layers=True)
  return (x1 > 0) & (x2 > 0), x1, x2


class OfficialSelection(NamedTuple):
  """Which slices the official recipe keeps, from the whole batch's valid counts (no gradient):
  `weight` `[B, S]`, `num_valid` `[B, S]`, `num_used` (m or the fallback), `scale` (fraction² + 1e-6).
  `row_ids` (`[B]`, None for `arange(B)`) are the rows' indices in the batch, their sampling keys."""
  weight: jax.Array
  num_valid: jax.Array
  num_used: jax.Array
  scale: jax.Array
  row_ids: jax.Array | None = None


def official_selection(num_valid: jax.Array, row_mask: jax.Array | None, num_samples: int,
                       cells: int) -> OfficialSelection:
  """The batch's kept slices (rules 3 and 4 of the module docstring) from each slice's valid count
  `[B, S]` and the slices' size `cells`; padding rows (`row_mask` 0) are never kept and left out of
  the smallest count and of the valid-cell fraction."""
  real = (jnp.ones(num_valid.shape[:1], bool) if row_mask is None
          else row_mask.astype(bool))[:, None]
  k = min(num_samples, cells)
  reaches = (num_valid >= num_samples) & real
  any_reaches = jnp.any(reaches)
  # Fallback of the public code: no slice reaches m -> all slices, m = min count.
  smallest = jnp.min(jnp.where(real, num_valid, k))
  num_used = jnp.where(any_reaches, k, jnp.minimum(smallest, k))
  weight = (jnp.where(any_reaches, reaches, num_used > 0) & real).astype(jnp.float32)
  cells_kept = jnp.maximum(jnp.sum(weight) * cells, 1.0)
  fraction = jnp.sum(weight * num_valid) / cells_kept
  scale = jax.lax.stop_gradient(jnp.square(fraction) + _OFFICIAL_SCALE_EPS)
  return OfficialSelection(weight, num_valid, num_used, scale)


def official_mi(valid: jax.Array, x1: jax.Array, x2: jax.Array, selection: OfficialSelection, rng: jax.Array, *,
                num_samples: int, rho2_eps: float = 1e-4, map_rows: Callable = all_rows_here):
  """(mi, rho `[B, S]`, indices, sample_weight `[B, S, k]`) of the slices `official_cells` cut, each kept
  slice (`selection.weight`) sampling k = min(m, C) cells with `fold_in(rng, row id)`, of which its
  first `num_used` are used."""
  k = min(num_samples, valid.shape[-1])

  def per_sentence(valid, x1, x2, weight, row_ids, num_used, rng):
    indices, picked = top_k_cells(valid, row_gumbel_noise(rng, row_ids, valid.shape[1:]), k)
    # Gumbel top-k is sorted, so its first num_used picks are a uniform subset too.
    sample_weight = picked * (jnp.arange(k) < num_used).astype(jnp.float32) * weight[..., None]
    u = safe_log(jnp.take_along_axis(x1, indices, -1), sample_weight, 1e-30)
    v = safe_log(jnp.take_along_axis(x2, indices, -1), sample_weight, 1e-30)
    rho, _ = weighted_pearson(u, v, sample_weight)
    return gaussian_mi(rho, rho2_eps), rho, indices, sample_weight

  row_ids = batch_row_ids(selection.row_ids, valid.shape[0])
  return map_rows(per_sentence, (valid, x1, x2, selection.weight, row_ids), (selection.num_used, rng))


def official_ami_loss(att1: jax.Array, att2: jax.Array, rng: jax.Array, *, weight: float = 2.5e-3,
                      num_samples: int = 150, rho2_eps: float = 1e-4, row_mask: jax.Array | None = None,
                      map_rows: Callable = all_rows_here, selection: OfficialSelection | None = None,
                      totals: Totals | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The AMI term as the official miCSE code computes it (module docstring, "official"):
  loss = -weight * ((fraction of valid cells)^2 + 1e-6) * mean MI over the kept slices (0 when
  none is kept). Its slices are (head, layer parity), so `att1`/`att2` hold an even number of
  layers; padding keys are exact zeros, so it needs no attention mask.

  For a block of a batch's rows, `selection` is the batch's `official_selection` at the block's rows
  (with their `row_ids`) and `totals` its denominators (`pairs`: Σ of its weight): the loss and the
  metrics are then the block's shares.

  Returns:
    (loss, metrics) with the metrics of `ami_loss` (`ami_samples`: samples per kept slice)
    plus `ami_scale`.
  """
  if selection is None:
    res = official_attention_mutual_information(att1, att2, rng, num_samples=num_samples,
                                                rho2_eps=rho2_eps, row_mask=row_mask,
                                                map_rows=map_rows)
    kept, num_used, scale, mi, rho = res.weight, res.num_used, res.scale, res.mi, res.rho
  else:
    valid, x1, x2 = official_cells(att1, att2)
    mi, rho, _, _ = official_mi(valid, x1, x2, selection, rng, num_samples=num_samples, rho2_eps=rho2_eps,
                                map_rows=map_rows)
    kept, num_used, scale = selection.weight, selection.num_used, selection.scale
  pairs = None if totals is None else totals.pairs
  mean_mi = weighted_mean(mi, kept, pairs)
  loss = -weight * scale * mean_mi
  metrics = {
      'ami': loss,
      'ami_mi': mean_mi,
      'ami_rho': weighted_mean(rho, kept, pairs),
      'ami_pairs': row_share(kept, row_mask, None if totals is None else totals.rows),
      'ami_samples': num_used.astype(jnp.float32),
      'ami_scale': scale,
  }
  return loss, metrics
