"""The cells of AMI (miCSE Alg. 1): attention regrouped into slices of cells, which cells are
valid, and uniform k-subsets of the valid cells by Gumbel-top-k.

Each sentence draws its noise from the step key folded with its global row index
(`row_gumbel_noise`), so a sentence samples the same cells whatever the batch's padded size,
the device count, or the device that holds it. `map_rows` functions say where the
per-sentence work runs: `all_rows_here` on one device, `training/data_parallel.py: rows_per_device`
per device under `shard_map`, so that no device samples (or gathers) another's sentences.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def slice_attention(att: jax.Array, heads_per_slice: int = 2,
                    pool_layers: bool = False) -> jax.Array:
  """Regroups `[L, B, H, T, T]` attention into `[B, S, C]` slices of cells.

  Default: slice = (layer, group of `heads_per_slice` adjacent heads), so
  S = L * H / heads_per_slice and C = heads_per_slice * T * T. With
  `pool_layers=True` the chosen layers of a head group share one slice:
  S = H / heads_per_slice and C = L * heads_per_slice * T * T.
  """
  num_layers, batch, heads, t_q, t_k = att.shape
  if heads % heads_per_slice:
    raise ValueError(f'{heads} heads cannot be grouped by heads_per_slice={heads_per_slice}')
  groups = heads // heads_per_slice
  att = att.reshape(num_layers, batch, groups, heads_per_slice, t_q, t_k)
  if pool_layers:
    att = jnp.transpose(att, (1, 2, 0, 3, 4, 5))  # [B, G, L, h, T, T]
    return att.reshape(batch, groups, num_layers * heads_per_slice * t_q * t_k)
  att = jnp.transpose(att, (1, 0, 2, 3, 4, 5))  # [B, L, G, h, T, T]
  return att.reshape(batch, num_layers * groups, heads_per_slice * t_q * t_k)


def fold_layer_parity(att: jax.Array) -> jax.Array:
  """`[L, B, H, T, T]` -> `[L/2, B, 2H, T, T]`; new head m*H + k is layer 2j+m, head k.

  `slice_attention(fold_layer_parity(att), heads_per_slice=1, pool_layers=True)`
  reproduces the slicing of the official miCSE code: one slice per (head, layer
  parity), pooling the layers of equal parity among the chosen ones.
  """
  num_layers, batch, heads, t_q, t_k = att.shape
  if num_layers % 2:
    raise ValueError(f'fold_layer_parity needs an even number of layers, got {num_layers}')
  att = att.reshape(num_layers // 2, 2, batch, heads, t_q, t_k)
  att = jnp.transpose(att, (0, 2, 1, 3, 4, 5))
  return att.reshape(num_layers // 2, batch, 2 * heads, t_q, t_k)


def cell_validity(att1: jax.Array, att2: jax.Array, attention_mask: jax.Array, *,
                  heads_per_slice: int = 2, pool_layers: bool = False,
                  require_positive: bool = True) -> jax.Array:
  """`[B, S, C]` bool: query and key are real tokens (and both views > 0 if asked).

  Args:
    att1: `[L, B, H, T, T]` first-view attention probabilities.
    att2: the same for the second view.
    attention_mask: `[B, T]`, 1 for real tokens.
    heads_per_slice: see `slice_attention`.
    pool_layers: see `slice_attention`.
    require_positive: also drop cells that are 0 in either view (attention
      dropout zeros, whose log is -inf).
  """
  tokens = attention_mask.astype(bool)
  pairs = tokens[:, :, None] & tokens[:, None, :]  # [B, Tq, Tk]
  valid = jnp.broadcast_to(pairs[None, :, None], att1.shape)
  if require_positive:
    valid = valid & (att1 > 0) & (att2 > 0)
  return slice_attention(valid, heads_per_slice, pool_layers)


def sample_cells(valid: jax.Array, rng: jax.Array,
                 num_samples: int) -> tuple[jax.Array, jax.Array]:
  """Uniform sampling without replacement among valid cells (Alg. 1, sampling step).

  Gumbel-top-k: with equal logits on the valid cells and -inf elsewhere, the k
  largest perturbed scores form a uniform random k-subset of the valid cells.
  When fewer than k cells are valid, the surplus picks carry weight 0.

  Args:
    valid: `[..., C]` bool.
    rng: PRNG key.
    num_samples: k; capped at C.

  Returns:
    (indices `[..., k]` int32, weights `[..., k]` float32 in {0, 1}).
  """
  return top_k_cells(valid, jax.random.gumbel(rng, valid.shape, jnp.float32), num_samples)


def top_k_cells(valid: jax.Array, noise: jax.Array,
                num_samples: int) -> tuple[jax.Array, jax.Array]:
  """`sample_cells` on given Gumbel `noise` (same shape as `valid`): the k valid cells with
  the largest noise, (indices `[..., k]`, weights `[..., k]` 1.0 where the pick is valid)."""
  k = min(num_samples, valid.shape[-1])
  scores = jnp.where(valid, noise, -jnp.inf)
  top, indices = jax.lax.top_k(scores, k)
  return indices, jnp.isfinite(top).astype(jnp.float32)


def row_gumbel_noise(rng: jax.Array, row_ids: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Gumbel noise `[B, *shape]` whose row b is drawn from `fold_in(rng, row_ids[b])`.

  A sentence's draw depends only on the step key and its global row index, not on the
  batch's padded size, on the device count or on which device holds the row.
  """
  return jax.vmap(lambda r: jax.random.gumbel(jax.random.fold_in(rng, r), shape, jnp.float32))(row_ids)


def all_rows_here(fn: Callable, rows: tuple, shared: tuple):
  """The `map_rows` of a single device: `fn(*rows, *shared)` on the whole batch.

  A `map_rows(fn, rows, shared)` computes `fn` on blocks of rows (leading axis of every
  array in `rows`; `shared` arrays whole), e.g. with `shard_map` over a data-parallel mesh
  (`training/data_parallel.py: rows_per_device`); `fn` must treat rows independently.
  """
  return fn(*rows, *shared)
