"""The packaged training and sweep configs, and how a `--config` value finds one.

The files live here (`micse_jax/configs/*.py`, `micse_jax/configs/sweeps/*.py`) so that an
installed wheel carries them; a checkout's top-level `configs/` is a symlink to this folder.
They import each other as `micse_jax.configs.<name>` (ml_collections loads a `--config` file
by path, so relative imports would not resolve).

`resolve("micse:demo")`: a `--config` value whose path part is an existing file is kept; any
other is looked up here: `micse` and `configs/micse.py` name `micse_jax/configs/micse.py`,
`sweeps/micse_paper` names `micse_jax/configs/sweeps/micse_paper.py`; the `:variant` is kept.
`available()` lists the names (`micse-train --list_configs`).
"""
from __future__ import annotations

import ast
import os

from micse_jax.errors import ConfigError

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
_HELPERS = {"__init__", "methods", "population_fields"}  # modules of this folder that are not configs


class ConfigNotFoundError(ConfigError):
  """A `--config` value is neither a file nor the name of a packaged config."""


def _packaged_path(name: str) -> str:
  """`configs/sweeps/x.py`, `sweeps/x.py` or `sweeps/x` → the file under CONFIG_DIR (may not exist)."""
  name = name.replace(os.sep, "/")
  if name.startswith("configs/"):
    name = name[len("configs/"):]
  if name.endswith(".py"):
    name = name[:-3]
  return os.path.join(CONFIG_DIR, *name.split("/")) + ".py"


def resolve(value: str) -> str:
  """`path[:variant]` with the path replaced by a packaged config's file when it is no file.

  Raises `ConfigNotFoundError` (one line) when it is neither."""
  path, sep, variant = value.partition(":")
  if os.path.isfile(path):
    return value
  packaged = _packaged_path(path)
  name = os.path.relpath(packaged, CONFIG_DIR)[:-3].replace(os.sep, "/")
  if path and not name.startswith("..") and os.path.basename(name) not in _HELPERS \
      and os.path.isfile(packaged):
    return packaged + sep + variant
  raise ConfigNotFoundError(f"--config {value}: {path!r} is neither a file nor a packaged config "
                            "(--list_configs lists them)")


def _summary(path: str) -> str:
  """The first line of a config file's docstring ('' when it has none)."""
  with open(path, encoding="utf-8") as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ""
  return doc.strip().splitlines()[0] if doc.strip() else ""


def available() -> list[tuple[str, str]]:
  """(name, first docstring line) of every packaged config: `micse`, ..., `sweeps/micse_paper`."""
  found = []
  for sub in ("", "sweeps"):
    folder = os.path.join(CONFIG_DIR, sub)
    for file in sorted(os.listdir(folder)):
      stem = file[:-3]
      if file.endswith(".py") and stem not in _HELPERS:
        found.append(((f"{sub}/" if sub else "") + stem, _summary(os.path.join(folder, file))))
  return found


def listing() -> str:
  """`available()` as text, one config a line (what `--list_configs` prints)."""
  width = max(len(name) for name, _ in available())
  lines = [f"{name:<{width}}  {summary}" for name, summary in available()]
  return "\n".join(lines + ["", "use as --config NAME[:VARIANT], e.g. --config micse:demo"])
