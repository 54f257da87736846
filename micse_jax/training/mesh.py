"""Data parallelism: one `Mesh` axis over every device of every host; batch split, state replicated."""
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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
