"""Data parallelism: one `Mesh` axis over every device of every host; batch split; state replicated,
or sharded over the same axis (FSDP / ZeRO-3, `mesh.shard_state`, see `state_sharding`)."""
import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from micse_jax.losses.ami_cells import all_rows_here

DATA_AXIS = "data"
MIN_SHARDED_ELEMENTS = 2 ** 14  # smaller leaves stay replicated: gathering them costs more than it saves
# An unset mesh.shard_state shards from this many GPUs: the time model predicts the sharded step the
# faster one from two (BENCHMARKS.md).
MIN_SHARDED_DEVICES = 2
# With the state sharded, gradient reduce-scatters are combined up to this many gradient bytes only
# (each device writing 1/N of them: XLA's threshold counts those): XLA's default combines them into
# one large reduce-scatter late in the backward, exposed (BENCHMARKS.md).
REDUCE_SCATTER_COMBINE_BYTES = 64 * 2 ** 20
# What XLA records into the step's CUDA graphs and how it keeps them current, by `mesh.cuda_graphs`
# (`cuda_graphs_for`; XLA's options `xla_gpu_enable_command_buffer`, `xla_gpu_command_buffer_update_mode`).
# "kernels": XLA's own kernels and custom calls (ours) only, cuBLAS and cuDNN calls between the graphs;
# "xla": XLA's default set, library calls in the graphs too; "fixed": XLA's default set at fixed
# device addresses (XLA remaps the call's buffers under them), so no graph is ever updated nor a
# library call captured again; "none": no CUDA graphs, every kernel launched on its own.
CUDA_GRAPHS = {"kernels": {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL"}, "xla": {},
               "fixed": {"xla_gpu_command_buffer_update_mode": "NEVER_UPDATE"},
               "none": {"xla_gpu_enable_command_buffer": ""}}


def maybe_initialize_distributed() -> None:
  """Multi-host: calls `jax.distributed.initialize()` when a launcher asked for it.

  Either JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID (launch/local_multiprocess.sh),
  or JAX_DISTRIBUTED=1 to let JAX discover the cluster itself (SLURM, TPU pods; launch/slurm.sbatch).
  """
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU-only multi-process
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]))
  elif os.environ.get("JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()


def data_mesh(devices=None) -> Mesh:
  """A 1-D mesh over all (or the given) devices, axis `DATA_AXIS`."""
  return Mesh(np.asarray(jax.devices() if devices is None else devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device holds the whole array."""
  return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
  """The leading (batch) dimension split over the data axis."""
  return NamedSharding(mesh, P(DATA_AXIS))


def chunk_sharded(mesh: Mesh) -> NamedSharding:
  """A call's chunk of batches `[steps, rows, ...]`: each step's rows split over the data axis."""
  return NamedSharding(mesh, P(None, DATA_AXIS))


def global_batch(local, mesh: Mesh, sharding: NamedSharding | None = None):
  """Assembles each host's rows into global arrays split like `sharding` (default: rows first,
  `batch_sharded`), one per leaf of `local`: a dict of arrays, or one packed array or chunk
  (`data/packing.py`).

  With one process the host holds the whole global batch, so `device_put` places it directly
  (half the host time of `make_array_from_process_local_data`).
  """
  sharding = batch_sharded(mesh) if sharding is None else sharding
  if jax.process_count() == 1:
    return jax.device_put(local, sharding)
  return jax.tree.map(lambda v: jax.make_array_from_process_local_data(sharding, v), local)


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


def cuda_graphs_for(mode: str, ampere_or_newer: bool) -> str:
  """`mesh.cuda_graphs` resolved: "auto" is "kernels" on a GPU of compute capability >= 8.0 and
  "xla" on older ones, what the last A/B measured. XLA records a library call into a graph by stream
  capture and captures it again whenever one of its buffers moved, which they do every call once
  the host runs ahead of the GPU; a step as short as an Ampere-or-newer GPU's at batch 50 then
  waited for the host (measured on an H200, BENCHMARKS.md), while a V100's step outlasts the capture
  (the time model's `host_work`) and keeps its GEMMs in the graphs. "fixed" and "none" are choices to
  measure (the GPU kit's A/B points), not yet anyone's default."""
  if mode != "auto":
    return mode
  return "kernels" if ampere_or_newer else "xla"


def compiler_options(sharded: bool, platform: str, devices: int, cuda_graphs: str | None = "kernels") -> dict:
  """The XLA options the step is compiled with. On CUDA GPUs: what goes into its CUDA graphs
  (`CUDA_GRAPHS[cuda_graphs]`), and with the state sharded over `devices`, gradient reduce-scatters
  combined up to `REDUCE_SCATTER_COMBINE_BYTES` of gradients, so they start under the backward.
  None elsewhere."""
  if platform != "cuda":
    return {}
  options = dict(CUDA_GRAPHS[cuda_graphs])
  if sharded:
    options["xla_gpu_reduce_scatter_combine_threshold_bytes"] = REDUCE_SCATTER_COMBINE_BYTES // max(devices, 1)
  return options


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


def padded_batch_size(batch_size: int, device_count: int) -> int:
  """The smallest multiple of `device_count` that is >= `batch_size`: rows per step on the mesh.

  A global batch the devices do not divide (the paper's 50 on 4 or 8 GPUs) is padded with
  masked rows (`row_mask` 0) that are no anchor, no negative, never enqueued and in no metric.
  """
  if batch_size <= 0 or device_count <= 0:
    raise ValueError(f"need a positive batch size and device count, got {batch_size}, {device_count}")
  return -(-batch_size // device_count) * device_count


def rows_per_device(mesh: Mesh | None):
  """A `map_rows(fn, rows, shared)` (losses/ami_cells.py) that runs `fn` under `shard_map` on
  each device's own block of rows (`rows` split over the data axis, `shared` replicated): no
  activation crosses devices. None or a one-device mesh: `fn` on the whole batch."""
  if mesh is None or mesh.size == 1:
    return all_rows_here

  def map_rows(fn, rows: tuple, shared: tuple):
    specs = (P(DATA_AXIS),) * len(rows) + (P(),) * len(shared)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(DATA_AXIS))(*rows, *shared)

  return map_rows


def placed(abstract, sharding):
  """`abstract` (ShapeDtypeStructs) with each leaf on its `sharding`."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, sharding)
