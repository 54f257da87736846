#!/usr/bin/env bash
# The GPU kit on a lent, offline GPU machine (docs/GPU_ACCEPTANCE.md): one command runs the kit's
# steps that fit its budget, a second one on the still-warm machine the rest.
#
#   scripts/device/kit.sh OUT [--budget_s S] [--steps a,b,...] [--retry] [--commit C] [--kit DIR] [--state DIR] [--dry]
#
# Installs the kit's wheels (scripts/device/wheels.sh) offline into a folder on PYTHONPATH
# (--no-index --no-deps --target; once per machine), then runs `python -m benchmarks.kit OUT`
# (benchmarks/kit.py: the steps, their order and budget, what OUT holds), its output also in
# OUT/kit.log; MICSE_DATA_DIR points at the kit's data (wheels.sh) when it has some. The steps'
# rows and the random BERT-base weights live in --state (default
# .kit_state in the checkout, which a warm machine keeps between commands), so the second
# command goes on where the first stopped. --commit records the commit measured (the lent
# machine's copy of the checkout has no git history). --dry: the same on CPU at tiny shapes, in
# a fresh state folder, with the wheels optional (the interpreter may already hold them).
# PYTHON picks the interpreter (default python3: on the lent image, the one that holds torch and jax).
set -euo pipefail

main() {  # the whole script is read before it runs (safe to edit while a run goes on)
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  [[ $# -ge 1 && "$1" != --* ]] || { echo "usage: ${BASH_SOURCE[0]} OUT [--budget_s S] [--kit DIR] [--dry] ..." >&2; exit 2; }
  out="$1"; shift
  kit="$repo/.kit"; dry=0; state=""; flags=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --kit) kit="$2"; shift 2 ;;
      --state) state="$2"; shift 2 ;;
      --commit) export MICSE_KIT_COMMIT="$2"; shift 2 ;;
      --budget_s|--steps) flags+=("$1" "$2"); shift 2 ;;
      --retry) flags+=("$1"); shift ;;
      --dry) dry=1; flags+=(--dry); shift ;;
      *) echo "error: unknown argument $1" >&2; exit 2 ;;
    esac
  done
  python="${PYTHON:-python3}"
  mkdir -p "$out"
  out="$(cd "$out" && pwd)"
  if [[ -z "$state" ]]; then
    if [[ "$dry" == 1 ]]; then state="$(mktemp -d "${TMPDIR:-/tmp}/micse_kit_dry.XXXXXX")"; else state="$repo/.kit_state"; fi
  fi
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
  if [[ -d "$kit/wheels" ]]; then
    site="${MICSE_KIT_SITE:-/tmp/micse_kit_site}"
    if [[ ! -f "$site/.installed" ]]; then
      rm -rf "$site"
      "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$site" "$kit"/wheels/*.whl
      touch "$site/.installed"
    fi
    export PYTHONPATH="$repo:$site"
  elif [[ "$dry" != 1 ]]; then
    echo "error: no wheels in $kit/wheels: run scripts/device/wheels.sh here and carry .kit" >&2; exit 1
  fi
  if [[ -d "$kit/data" ]]; then
    export MICSE_DATA_DIR="$kit/data"  # the trainer's data (wheels.sh); else shared/data above the checkout
  fi
  export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  if [[ "$dry" == 1 ]]; then
    export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
  fi
  cd "$repo"
  "$python" -m benchmarks.kit "$out" --state "$state" ${flags[@]+"${flags[@]}"} 2>&1 | tee -a "$out/kit.log"
}

main "$@"
