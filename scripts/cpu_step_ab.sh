#!/bin/bash
# The CPU step of two commits, timed back to back and interleaved, one bench process per run:
#   bash scripts/cpu_step_ab.sh [BASE [NEW [ROUNDS]]]      (defaults: d8bcc15 HEAD 3)
# Each commit's tree is exported (git archive) to a temporary directory and run from there with
# `python -m micse_jax.bench --model minilm --batch_size 64 --max_length 32 --steps 5 --no_torch
# --no_breakdown --no-encode` (MiniLM, fp32, 64 x 2 views x 32 tokens), in the order BASE NEW,
# NEW BASE, BASE NEW, ... so a drifting load falls on both. Prints each run's blocked step (the
# median of --steps steps, each waited for: what both commits' bench reports) with the 1-minute
# load beside it, then the medians and NEW / BASE. Run from the repository, in its Python
# environment, on a machine as quiet as you can get.
set -euo pipefail
base=${1:-d8bcc15}
new=${2:-HEAD}
rounds=${3:-3}
repo=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for c in "$base" "$new"; do
  mkdir -p "$tmp/$c"
  git -C "$repo" archive "$c" | tar -x -C "$tmp/$c"
done
echo "cpu_step_ab: $base ($(git -C "$repo" rev-parse --short "$base")) vs $new ($(git -C "$repo" rev-parse --short "$new")), $rounds rounds, $(nproc) CPUs"
results="$tmp/results"
for ((r = 0; r < rounds; r++)); do
  order=("$base" "$new")
  if ((r % 2)); then order=("$new" "$base"); fi
  for c in "${order[@]}"; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    json=$(cd "$tmp/$c" && PYTHONPATH="$tmp/$c" python -m micse_jax.bench --model minilm --batch_size 64 \
        --max_length 32 --steps 5 --no_torch --no_breakdown --no-encode 2>/dev/null | tail -n 1)
    # the bench's last line is its JSON row: jax.step_ms (older bench, blocked) or jax.blocked_step_ms
    ms=$(python -c 'import json, sys; j = json.loads(sys.argv[1])["jax"]; print(round(j.get("blocked_step_ms", j.get("step_ms")), 1))' "$json")
    echo "round $r  $c  ${ms} ms  (load before: $load, after: $(cut -d' ' -f1 /proc/loadavg))"
    echo "$c $ms" >> "$results"
  done
done
python - "$results" "$base" "$new" <<'EOF'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
med = {c: statistics.median(float(ms) for name, ms in rows if name == c) for c in sys.argv[2:]}
base, new = sys.argv[2:]
print(f"median: {base} {med[base]:.1f} ms, {new} {med[new]:.1f} ms; {new} / {base} = {med[new] / med[base]:.3f}")
EOF
