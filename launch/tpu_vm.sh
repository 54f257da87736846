#!/usr/bin/env bash
# Run the same micse_jax command on every worker of a Cloud TPU VM slice (one process per host).
#
#   launch/tpu_vm.sh TPU_NAME ZONE [--project P] -- python -m micse_jax.main \
#       --config configs/micse.py --workdir gs://bucket/runs/micse \
#       --config.data.corpus=/data/wiki1m_bert32    # a prepared directory present on every worker
#
# Every worker must hold this repository at the same path (REMOTE_DIR, default ~/micse_jax) with
# its requirements and the TPU runtime installed: requirements.txt pins jax but not libtpu, without
# which jax finds no TPU (`launch/tpu_vm.sh NAME ZONE -- pip install -r requirements.txt -r
# requirements-tpu.txt`). Check a config against the slice before renting it: `python -m
# micse_jax.bench --aot tpu-v5e --devices 4 --model bert-base --batch_size 512 --dtype bfloat16` compiles
# the step for it on any machine and prints its memory per chip (v5e: 16 GiB HBM, v4: 32 GiB) and
# collectives (docs/AOT.md, BENCHMARKS.md).
# JAX_DISTRIBUTED=1 makes micse_jax call jax.distributed.initialize(), which finds the slice's
# coordinator and process ids itself on TPU VMs; each host then reads only its rows of each batch.
# Set DRY_RUN=1 to print the gcloud command instead of running it.
set -euo pipefail

if [[ $# -lt 4 ]]; then
  echo "usage: $0 TPU_NAME ZONE [gcloud options...] -- COMMAND..." >&2
  exit 2
fi
tpu_name=$1
zone=$2
shift 2
gcloud_options=()
while [[ $# -gt 0 && $1 != "--" ]]; do
  gcloud_options+=("$1")
  shift
done
if [[ $# -eq 0 ]]; then
  echo "error: missing '--' before the command to run" >&2
  exit 2
fi
shift  # the --
if [[ $# -eq 0 ]]; then
  echo "error: no command after '--'" >&2
  exit 2
fi
remote_dir=${REMOTE_DIR:-'~/micse_jax'}
command=$(printf '%q ' "$@")
remote="cd ${remote_dir} && JAX_DISTRIBUTED=1 PYTHONPATH=. ${command}"
gcloud_cmd=(gcloud compute tpus tpu-vm ssh "$tpu_name" --zone "$zone" --worker=all
            ${gcloud_options[@]+"${gcloud_options[@]}"} --command "$remote")
if [[ ${DRY_RUN:-0} == 1 ]]; then
  printf '%q ' "${gcloud_cmd[@]}"
  echo
else
  exec "${gcloud_cmd[@]}"
fi
