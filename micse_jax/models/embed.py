"""Embedding lookups of BERT's three tables whose gradients suit the GPU.

* Half precision: flax's `nn.Embed` casts the whole table to the compute dtype before `take`, so
  the gradient's scatter-add into the table runs in bfloat16/float16, a contended half-precision
  scatter (every token adds into row 0 of the token-type table) that took most of a BERT-base step on
  a GPU and a small part of it in float32 (BENCHMARKS.md, GPU section); XLA:CPU upcasts it, so a CPU
  never shows it. `Embed` gathers the float32 rows and casts the result: the same forward values
  (the cast commutes with the gather) and a float32 scatter-add in the backward pass.
* Small tables (<= `SMALL_TABLE` rows, the token types): even in float32 the scatter-add's atomics
  into two rows run one after another (every token adds into the same 768 addresses). Where the
  model's policy targets CUDA (`Policy.own_gradients`) the gradient of row k is instead the column
  sum of the output gradient where the id is k, for every k in one pass (`models/column_sums.py`):
  dE_k = Σ_tokens [id = k] · g. Elsewhere the scatter-add.
* Several devices with the train state sharded (`Policy.table_mesh` of the policy in effect): the state holds
  each table split by its features over the mesh (`training/state_placement.leaf_partition`). Gathering the vocabulary whole for each
  step's lookup moves the table (94 MB in float32 for BERT's) to every device; each device instead
  looks its features up for the whole batch's ids and an all-to-all exchanges the rows
  (`split_lookup`, a few MB), where that moves fewer bytes (`splits_lookup`). Small tables (the
  positions) are gathered whole where they are used (`whole_on`), as is the table the MLM decoder
  attends with. The same values either way.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from micse_jax.kernels.choice import OWN_GRADIENT_SCOPE
from micse_jax.models import policy
from micse_jax.models.column_sums import RowSums, column_sums

SMALL_TABLE = 16  # rows up to which a lookup's gradient is summed per row on CUDA, not scattered


def _take(table: Array, ids: Array) -> Array:
  return jnp.take(table, ids, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _summed_lookup(table: Array, ids: Array, rows: int, sums: RowSums = RowSums()) -> Array:
  """take(table, ids); the table's gradient by per-row column sums (module docstring), summed over the
  ids' rows as `sums` says (`column_sums`)."""
  del rows, sums
  return _take(table, ids)


def _summed_lookup_forward(table, ids, rows, sums):
  del rows, sums
  return _take(table, ids), ids


def _summed_lookup_backward(rows, sums, ids, g):
  with jax.named_scope(OWN_GRADIENT_SCOPE):  # a CUDA gradient of ours (`kernels/choice.OWN_MARKS`)
    masked = tuple(jnp.where((ids == k)[..., None], g, jnp.zeros((), g.dtype)) for k in range(rows))
    return jnp.stack(column_sums(*masked, sums=sums)), None


_summed_lookup.defvjp(_summed_lookup_forward, _summed_lookup_backward)


def small_table_lookup(table: Array, ids: Array, sums: RowSums | None = None) -> Array:
  """take(table, ids): with the per-row summed gradient, summed over the ids' rows as `sums` says, where
  the CUDA gradients are chosen (`sums`, `Policy.row_sums`); with the scatter-add where `sums` is None."""
  if sums is None:
    return _take(table, ids)
  return _summed_lookup(table, ids, table.shape[0], sums)


def splits_lookup(rows: int, features: int, ids_shape: tuple[int, ...], devices: int, itemsize: int) -> bool:
  """Whether a table of `rows` float32 rows is looked up split over `devices` (`split_lookup`) rather
  than gathered whole: its features and the ids' leading (batch) axis divide among the devices, and
  gathering would move more: each device receives (D-1)/D of the table (4 bytes a value) gathered,
  (D-1)/D of its own ids' rows (`itemsize` bytes a value) exchanged."""
  own_ids = math.prod(ids_shape) // max(devices, 1)
  return (devices > 1 and len(ids_shape) >= 1 and ids_shape[0] % devices == 0 and features % devices == 0
          and rows * 4 > own_ids * itemsize)


def split_lookup(table: Array, ids: Array, dtype, mesh) -> Array:
  """take(table, ids).astype(dtype) with the table's features split over `mesh`'s axis and the ids'
  leading (batch) axis over it: each device looks its features up for every id of the batch, and an
  all-to-all hands each device its own ids' rows, whole. The table is never gathered; its gradient
  comes back the same way and is scattered into each device's features (float32, as `_take`), where
  the sharded state holds them (`training/state_placement.leaf_partition`)."""
  axis = mesh.axis_names[0]

  def on_device(features, own_ids):
    looked_up = _take(features, jax.lax.all_gather(own_ids, axis, tiled=True)).astype(dtype)
    # Exchanged along the major axis (device j's features of my rows arrive as block j), then set
    # side by side here: an exchange into the minor axis leaves XLA a transposed layout for the
    # activations of the whole encoder.
    blocks = jax.lax.all_to_all(looked_up, axis, 0, 0, tiled=True)
    blocks = blocks.reshape(mesh.size, -1, *blocks.shape[1:])
    return jnp.moveaxis(blocks, 0, -2).reshape(*blocks.shape[1:-1], -1)
  return jax.shard_map(on_device, mesh=mesh, in_specs=(P(None, axis), P(axis)), out_specs=P(axis))(table, ids)


def whole_on(table: Array, mesh) -> Array:
  """`table` whole on every device of `mesh` (FSDP's gather where it is used); as is without a mesh."""
  if mesh is None or mesh.size == 1:
    return table
  return jax.lax.with_sharding_constraint(table, NamedSharding(mesh, P()))


class Embed(nn.Embed):
  """`nn.Embed` (same parameter, same `attend`) whose lookup is `take(float32 table).astype(dtype)`.
  Where the table lies and how its gradient is summed are the policy in effect's (`policy.current`):
  a table that arrives split by features over its mesh (`Policy.table_mesh`; None: whole) is looked
  up split (`split_lookup`) if large, gathered whole if small; a small table's gradient is the per-row
  sum where the policy takes the CUDA gradients (`Policy.row_sums`)."""

  def __call__(self, inputs: Array) -> Array:
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    applied = policy.current()
    mesh = applied.table_mesh
    dtype = self.dtype or self.embedding.dtype
    devices = 1 if mesh is None else mesh.size
    if splits_lookup(self.num_embeddings, self.features, inputs.shape, devices, jnp.dtype(dtype).itemsize):
      return split_lookup(self.embedding, inputs, dtype, mesh)
    table = whole_on(self.embedding, mesh)
    if self.num_embeddings <= SMALL_TABLE:
      return small_table_lookup(table, inputs, applied.row_sums if applied.own_gradients else None).astype(dtype)
    return _take(table, inputs).astype(dtype)

  def attend(self, query: Array) -> Array:
    """`nn.Embed.attend` (query · tableᵀ) on the whole table (`whole_on`: gathered if it arrives split)."""
    query, embedding = self.promote_dtype(query, whole_on(self.embedding, policy.current().table_mesh),
                                          dtype=self.dtype)
    return jnp.dot(query, embedding.T)
