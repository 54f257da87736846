"""Multi-host start (`jax.distributed.initialize()` when a launcher asked for it) and the devices a run
takes."""
import os

import jax
import ml_collections

from micse_jax.configs import population_fields
from micse_jax.errors import ConfigError


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


def devices_for(config: ml_collections.ConfigDict) -> list:
  """The devices a run trains on: every device of every process; a population's, this host's only."""
  if population_fields.enabled(config) and jax.process_count() > 1:
    raise ConfigError("population training runs on one host (several devices are fine)")
  return jax.devices()
