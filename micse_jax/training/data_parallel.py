"""Data parallelism: one `Mesh` axis over every device of every host; each step's rows split over it
(`batch_sharded`, a call's chunk `chunk_sharded`), padded to a multiple of the devices
(`padded_batch_size`), and per-device row maps (`rows_per_device`). Where the train state lives
on that mesh is `training/state_placement.py`'s."""
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from micse_jax.losses.ami_cells import all_rows_here

DATA_AXIS = "data"


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
