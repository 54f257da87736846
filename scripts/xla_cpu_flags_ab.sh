#!/bin/bash
# The micse_jax step (MiniLM, 64 x 2 x 32, fp32) under candidate XLA CPU flags, one process each.
#   bash scripts/xla_cpu_flags_ab.sh [extra bench args]
# Prints one "flags -> step ms" line per setting; run on a quiet machine.
set -uo pipefail
settings=(
  ""
  "--xla_cpu_use_onednn=true"
  "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot"
  "--xla_cpu_experimental_ynn_fusion_type=dot"
  "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY"
)
for flags in "${settings[@]}"; do
  echo "== XLA_FLAGS='$flags'; $(uptime)"
  XLA_FLAGS="$flags" python -m micse_jax.bench --model minilm --batch_size 64 --no_torch --no-encode \
      --no_breakdown --steps 6 --warmup 2 "$@" 2>&1 | grep -E "compile time|micse_jax step|Error|error"
done
