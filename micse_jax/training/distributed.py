"""Multi-host start: `jax.distributed.initialize()` when a launcher asked for it."""
import os

import jax


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
