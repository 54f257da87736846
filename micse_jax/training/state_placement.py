"""Where the train state lives on the data mesh: replicated, or sharded over its axis (FSDP / ZeRO-3,
`mesh.shard_state`; ZeRO-1/2, `mesh.shard_update`), leaf by leaf (`leaf_partition`), and the
constraints the step places its trees by (`gathered_for_compute`, `split_for_update`)."""
import math

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from micse_jax.training.data_parallel import DATA_AXIS, replicated

MIN_SHARDED_ELEMENTS = 2 ** 14  # smaller leaves stay replicated: gathering them costs more than it saves
# An unset mesh.shard_state shards from this many GPUs: the time model predicts the sharded step the
# faster one from two (BENCHMARKS.md).
MIN_SHARDED_DEVICES = 2

TABLE_KEY = "embedding"  # the parameter name of an embedding table (`nn.Embed`, `models/embed.Embed`)


def is_table(path) -> bool:
  """Whether a state leaf at `path` (a key path) is an embedding table, or its moment or EMA."""
  return bool(path) and getattr(path[-1], "key", None) == TABLE_KEY


def leaf_partition(shape: tuple[int, ...], num_devices: int, min_elements: int = MIN_SHARDED_ELEMENTS,
                   table: bool = False) -> P:
  """FSDP placement of one state leaf: split its first (major-most) dimension that `num_devices`
  divides; an embedding table (`table`) by its features (its last dimension) first.

  The major-most dimension keeps each device's slice contiguous in the row-major layout the
  update reads, so a gradient reduce-scattered into it needs no transpose (a [768, 3072] kernel
  split by its 3072 columns came out of the reduce-scatter in a transposed layout and was
  transposed back, with its moments, every step: BENCHMARKS.md). A table is split by features
  because its lookup needs every row: each device looks up its own features (`models/embed.py`).
  Replicated (`P()`) when the leaf has fewer than `min_elements` elements, when no dimension
  is divisible, or on one device.
  """
  if num_devices <= 1 or math.prod(shape) < min_elements:
    return P()
  order = list(range(len(shape)))
  for dim in (order[-1:] + order[:-1]) if table else order:
    if shape[dim] % num_devices == 0:
      return P(*([None] * dim + [DATA_AXIS]))
  return P()


def shards_state(mesh_config, num_devices: int, platform: str, members: int = 0) -> bool:
  """Whether the train state is sharded (FSDP, `state_sharding`): `mesh.shard_state` when it is set;
  unset (None, the default), where the time model predicts the faster step: one run (no population)
  data parallel over `MIN_SHARDED_DEVICES` or more CUDA GPUs, without `mesh.shard_update`. There the
  step gathers only what it computes with, the half-precision weight copies, under the forward, looks
  the word embeddings up split (`models/embed.py`), reduce-scatters the gradients instead of
  all-reducing them, and each device updates 1/N of the state; replicated, every device updates the
  whole state after the gradients' all-reduce (BENCHMARKS.md, docs/scaling-and-clusters.md). Elsewhere replicated: one device, a
  population (members' states stay whole), CPU (nothing measured to choose by) and TPU (the time
  model's TPU prices are not calibrated)."""
  chosen = mesh_config.get("shard_state")
  if chosen is not None:
    return bool(chosen)
  return (num_devices >= MIN_SHARDED_DEVICES and platform == "cuda" and not members
          and not mesh_config.get("shard_update", False))


def state_sharding(state_shapes, mesh: Mesh, shard_state: bool, min_elements: int = MIN_SHARDED_ELEMENTS,
                   shard_update: bool = False):
  """The train state's shardings (a tree of `NamedSharding` like `state_shapes`).

  shard_state=False: every leaf replicated (plain data parallelism). True: FSDP / ZeRO-3 —
  params, EMA params, optimizer moments and the queue split over the data axis leaf by leaf
  (`leaf_partition`); under `jax.jit` GSPMD all-gathers each parameter where the step uses it
  and reduce-scatters its gradient, so every device holds 1/N of the state. shard_update (without
  shard_state): ZeRO-1/2 — the optimizer moments split, the rest replicated; the step updates 1/N
  of every leaf per device (`split_for_update`). Checkpoints store the global arrays, so they
  restore onto any other mesh (`training/checkpoint.py`).
  """
  split = _split(mesh, min_elements)
  whole = lambda leaf: NamedSharding(mesh, P())
  placed = jax.tree_util.tree_map_with_path(split, state_shapes) if shard_state else jax.tree.map(whole, state_shapes)
  if shard_update and not shard_state:
    placed = placed.replace(opt_state=jax.tree_util.tree_map_with_path(split, state_shapes.opt_state))
  return placed


def _split(mesh: Mesh, min_elements: int):
  """(path, leaf) -> its `leaf_partition` over `mesh` (1/N of the leaf per device, small leaves whole)."""
  return lambda path, leaf: NamedSharding(mesh, leaf_partition(tuple(leaf.shape), mesh.size, min_elements,
                                                               table=is_table(path)))


def split_for_update(tree, mesh: Mesh | None, on: bool, min_elements: int = MIN_SHARDED_ELEMENTS):
  """ZeRO-2's update: `tree` (gradients, params, EMA) constrained to 1/N of each leaf per device
  (`leaf_partition`), so GSPMD reduce-scatters the gradients instead of all-reducing them, each
  device updates its slice of the params, moments and EMA (and casts its slice of the copies),
  and the new params, EMA and copies are all-gathered to the replicated state. The same values as
  the replicated update up to the order of the gradient sums. No-op unless `on` on several devices."""
  if not on or mesh is None or mesh.size == 1:
    return tree
  return jax.lax.with_sharding_constraint(tree, jax.tree_util.tree_map_with_path(_split(mesh, min_elements), tree))


def gathered_for_compute(tree, mesh: Mesh | None, sharded: bool):
  """FSDP's gather: `tree` (sharded state leaves) constrained to be whole on every device where the
  step computes with it. Without this, GSPMD propagates a parameter's split (e.g. on a weight's
  output dimension = the heads) into the activations and reshuffles them between devices
  (all-to-alls of attention maps); with it, the only collectives FSDP adds are the parameters'
  all-gathers and the gradients' reduction to the owning shard. Embedding tables (`is_table`) are
  left as they are: their lookups gather them, or look them up split, themselves (`models/embed.py`).
  No-op unless `sharded`."""
  if not sharded or mesh is None or mesh.size == 1:
    return tree
  whole = replicated(mesh)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: leaf if is_table(path) else jax.lax.with_sharding_constraint(leaf, whole), tree)


def placed(abstract, sharding):
  """`abstract` (ShapeDtypeStructs) with each leaf on its `sharding`."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, sharding)
