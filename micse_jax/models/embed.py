"""Embedding lookups of BERT's three tables whose gradients suit the GPU.

* Half precision: flax's `nn.Embed` casts the whole table to the compute dtype before `take`, so
  the gradient's scatter-add into the table runs in bfloat16/float16. On an H100 that scatter
  took 35 ms of a 55 ms BERT-base step at batch 50 (all 3,200 tokens add into row 0 of the
  token-type table), 0.07 ms in float32 (BENCHMARKS.md, GPU section); XLA:CPU upcasts it, so a CPU
  never shows it. `Embed` gathers the float32 rows and casts the result: the same forward values
  (the cast commutes with the gather) and a float32 scatter-add in the backward pass.
* Small tables (<= `SMALL_TABLE` rows, the token types): even in float32 the scatter-add's atomics
  into two rows run one after another (every token adds into the same 768 addresses). On CUDA the
  gradient of row k is instead the column sum of the output gradient where the id is k, for every
  k in one pass (`models/column_sums.py`): dE_k = Σ_tokens [id = k] · g. Elsewhere the scatter-add.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from micse_jax.models.column_sums import column_sums

SMALL_TABLE = 16  # rows up to which a lookup's gradient is summed per row on CUDA, not scattered


def _take(table: Array, ids: Array) -> Array:
  return jnp.take(table, ids, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _summed_lookup(table: Array, ids: Array, rows: int) -> Array:
  """take(table, ids); the table's gradient by per-row column sums (module docstring)."""
  del rows
  return _take(table, ids)


def _summed_lookup_forward(table, ids, rows):
  del rows
  return _take(table, ids), ids


def _summed_lookup_backward(rows, ids, g):
  masked = tuple(jnp.where((ids == k)[..., None], g, jnp.zeros((), g.dtype)) for k in range(rows))
  return jnp.stack(column_sums(*masked)), None


_summed_lookup.defvjp(_summed_lookup_forward, _summed_lookup_backward)


def small_table_lookup(table: Array, ids: Array) -> Array:
  """take(table, ids): on CUDA with the per-row summed gradient, elsewhere with the scatter-add."""
  summed = lambda table, ids: _summed_lookup(table, ids, table.shape[0])
  return jax.lax.platform_dependent(table, ids, cuda=summed, default=_take)


class Embed(nn.Embed):
  """`nn.Embed` (same parameter, same `attend`) whose lookup is `take(float32 table).astype(dtype)`."""

  def __call__(self, inputs: Array) -> Array:
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    lookup = small_table_lookup if self.num_embeddings <= SMALL_TABLE else _take
    return lookup(self.embedding, inputs).astype(self.dtype or self.embedding.dtype)
