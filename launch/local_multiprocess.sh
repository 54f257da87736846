#!/usr/bin/env bash
# Multi-process training on one machine (e.g. to try the multi-host path on CPU):
#   launch/local_multiprocess.sh NUM_PROCESSES --config configs/micse.py:demo --workdir runs/mp
# Each process gets JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, which
# micse_jax.training.distributed.maybe_initialize_distributed() passes to jax.distributed.initialize().
set -euo pipefail
n=${1:?number of processes}; shift
port=${JAX_PORT:-$((20000 + RANDOM % 20000))}
pids=()
for ((i = 0; i < n; i++)); do
  JAX_COORDINATOR_ADDRESS=127.0.0.1:$port JAX_NUM_PROCESSES=$n JAX_PROCESS_ID=$i \
    python -m micse_jax.main "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
