"""Data parallelism: one `Mesh` axis over every device of every host; batch split, state replicated."""
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from micse_jax.losses.ami_cells import all_rows_here

DATA_AXIS = "data"


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


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each host's rows into one global, batch-sharded array per key."""
  sharding = batch_sharded(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


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
