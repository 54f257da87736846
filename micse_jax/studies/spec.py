"""Sweep configs and their expansion into runs (the grid of a few-shot / ablation study).

A sweep config (`configs/sweeps/*.py`, `get_config(arg)`) is an ml_collections ConfigDict:

    name             study name (default sweep directory: runs/sweeps/<name>)
    base_config      training config used when there is no `method` axis ("configs/micse.py")
    overrides        ((field, value), ...) applied to every run
    axes             ((key, (value, ...)), ...), expanded as a Cartesian product in this order
    num_train_steps  held constant across sizes (the paper's protocol)
    eval_tasks       `eval.final_tasks` of every run ("sts", "all", "STSBenchmark,...")

Axis keys: `method` (a config name in configs/, or `path.py[:variant]`), `seed` (sets `seed`
and `data.subset_seed` together), or any training-config field such as `data.num_sentences`
(absolute sizes; a float in (0, 1] is a fraction of the corpus, 0 means all of it),
`ami.weight`, `batch_size`, `model.name_or_path`.

Each run gets a workdir named by its axis values, e.g. `method=simcse__data.num_sentences=64__seed=0`,
and is an ordinary `python -m micse_jax.main --config FILE --workdir DIR --config.<field>=<value> ...`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import re
import sys

import ml_collections

from micse_jax.errors import ConfigError, MicseError
from micse_jax.paths import REPO

SPECIAL_AXES = ("method", "seed")


class SweepError(ConfigError):
  """Bad sweep config (unknown axis key, empty axis, incompatible data...): one line, before any run."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One training run of a sweep."""
  name: str                  # workdir name, from the axis values
  config_file: str           # path.py[:variant] given to micse_jax.main --config
  overrides: tuple           # ((field, value), ...) given as --config.<field>=<value>
  labels: tuple              # ((axis key, value as written in the sweep), ...)
  workdir: str

  def label(self, key: str, default=None):
    """The value this run's axis `key` took (as written in the sweep), or `default`."""
    return dict(self.labels).get(key, default)

  def override(self, key: str, default=None):
    """The value this run passes for config field `key`, or `default`."""
    return dict(self.overrides).get(key, default)


def load_config_file(spec: str, arg_default: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file `path.py[:arg]` (paths relative to the repository)."""
  path, _, arg = spec.partition(":")
  full = path if os.path.isabs(path) else os.path.join(REPO, path)
  if not os.path.isfile(full):
    raise SweepError(f"config file not found: {path}")
  if REPO not in sys.path:
    sys.path.insert(0, REPO)  # configs import `from configs import default`
  module_spec = importlib.util.spec_from_file_location(f"_sweep_cfg_{abs(hash(full))}", full)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or arg_default)


def method_config_file(method: str) -> str:
  """'simcse' → 'configs/simcse.py'; a 'path.py[:variant]' is kept."""
  return method if ".py" in method else os.path.join("configs", f"{method}.py")


def method_name(config_file: str) -> str:
  """'configs/simcse.py:demo' → 'simcse:demo' (the label used in tables)."""
  path, _, arg = config_file.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return f"{name}:{arg}" if arg else name


def set_field(config: ml_collections.ConfigDict, key: str, value, source: str) -> None:
  """config[key] = value for a dotted key; SweepError for an unknown field or a bad type."""
  node, parts = config, key.split(".")
  for i, part in enumerate(parts):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise SweepError(f"unknown axis/override key {key!r}: {'.'.join(parts[:i + 1])} is not a field "
                       f"of {source} (see configs/default.py)")
    if i < len(parts) - 1:
      node = node[part]
  try:
    node[parts[-1]] = value
  except (TypeError, ValueError) as e:
    raise SweepError(f"bad value {value!r} for {key} in {source}: {e}") from e


def _format(value) -> str:
  """A value as written on the command line / in a workdir name."""
  if isinstance(value, (tuple, list)):
    return "(" + ",".join(_format(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def _safe(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9._=+,()-]", "-", text)


def validate_sweep(sweep: ml_collections.ConfigDict) -> list[tuple[str, tuple]]:
  """Checks the axes' shape (non-empty, no duplicates); returns them as a list of (key, values)."""
  axes = [(str(k), tuple(v) if isinstance(v, (list, tuple)) else (v,)) for k, v in sweep.axes]
  keys = [k for k, _ in axes]
  for key, values in axes:
    if not values:
      raise SweepError(f"sweep {sweep.name!r}: axis {key!r} is empty")
    if keys.count(key) > 1:
      raise SweepError(f"sweep {sweep.name!r}: axis {key!r} appears twice")
    if len(set(map(_format, values))) != len(values):
      raise SweepError(f"sweep {sweep.name!r}: axis {key!r} repeats a value: {values}")
  if "seed" in keys and any(k in ("data.subset_seed",) for k in keys):
    raise SweepError("axis 'seed' already sets data.subset_seed; drop the 'data.subset_seed' axis")
  return axes


def _resolve_size(value, corpus: str, sizes_cache: dict) -> int:
  """data.num_sentences: an int is absolute (0 = all); a float in (0, 1] is a corpus fraction."""
  if isinstance(value, float):
    if not 0 < value <= 1:
      raise SweepError(f"data.num_sentences fraction must be in (0, 1], got {value}")
    if value == 1.0:
      return 0
    if corpus not in sizes_cache:
      from micse_jax.data.prepared import corpus_size  # pylint: disable=import-outside-toplevel
      try:
        sizes_cache[corpus] = corpus_size(corpus)
      except MicseError as e:
        raise SweepError(str(e)) from e
    return max(1, int(round(value * sizes_cache[corpus])))
  return int(value)


def expand(sweep: ml_collections.ConfigDict, sweep_dir: str) -> list[RunSpec]:
  """All runs of the sweep, in axis order; every override checked against its config first."""
  axes = validate_sweep(sweep)
  keys = [k for k, _ in axes]
  sizes_cache: dict = {}
  runs, loaded = [], {}
  for combo in itertools.product(*(values for _, values in axes)):
    labels = tuple(zip(keys, combo))
    values = dict(labels)
    config_file = method_config_file(str(values["method"])) if "method" in values else sweep.base_config
    if config_file not in loaded:
      loaded[config_file] = load_config_file(config_file)
    config = loaded[config_file].copy_and_resolve_references()
    overrides = list(sweep.overrides) + [("num_train_steps", sweep.num_train_steps),
                                         ("eval.final_tasks", sweep.eval_tasks)]
    for key, value in labels:
      if key == "seed":
        overrides += [("seed", int(value)), ("data.subset_seed", int(value))]
      elif key != "method":
        overrides.append((key, value))
    overrides = list(dict(overrides).items())  # a later setting of a field wins
    for key, value in overrides:
      if key != "data.num_sentences":
        set_field(config, key, value, config_file)
    if "data.num_sentences" in dict(overrides):  # fractions need the (overridden) corpus
      resolved = _resolve_size(dict(overrides)["data.num_sentences"], config.data.corpus, sizes_cache)
      overrides = [(k, resolved if k == "data.num_sentences" else v) for k, v in overrides]
      set_field(config, "data.num_sentences", resolved, config_file)
    _check_run_config(config, config_file)
    name = _safe("__".join(f"{k}={_format(v)}" for k, v in labels)) or "run"
    runs.append(RunSpec(name=name, config_file=config_file, overrides=tuple(overrides), labels=labels,
                        workdir=os.path.join(sweep_dir, name)))
  return runs


def _check_run_config(config: ml_collections.ConfigDict, source: str) -> None:
  """All the trainer's config checks (`config_checks.check_config`), before any run starts."""
  from micse_jax import config_checks  # pylint: disable=import-outside-toplevel
  try:
    config_checks.check_config(config)
  except ConfigError as e:
    raise SweepError(f"{source} with the sweep's overrides: {e}") from e


def check_data(runs: list[RunSpec]) -> None:
  """Prepared corpora must match each run's tokenizer and max_length (SweepError otherwise)."""
  from micse_jax.data import prepared  # pylint: disable=import-outside-toplevel
  seen = set()
  for run in runs:
    config = load_config_file(run.config_file)
    for key, value in run.overrides:
      set_field(config, key, value, run.config_file)
    corpus, model, length = config.data.corpus, config.model.name_or_path, config.model.max_length
    if (corpus, model, length) in seen or not os.path.isdir(corpus):
      continue
    seen.add((corpus, model, length))
    from micse_jax.models.loading import resolve_model_dir  # pylint: disable=import-outside-toplevel
    from micse_jax.tokenization import Tokenizer  # pylint: disable=import-outside-toplevel
    try:
      rows = prepared.PreparedRows(corpus)
      prepared.check_compatible(rows.metadata, corpus, Tokenizer.from_pretrained(resolve_model_dir(model)), length)
    except (MicseError, ValueError, FileNotFoundError) as e:  # the tokenizer raises ValueError
      raise SweepError(f"run {run.name}: {e}") from e


def main_command(run: RunSpec, python: str = sys.executable) -> list[str]:
  """The `micse_jax.main` command line of a run."""
  return [python, "-m", "micse_jax.main", f"--config={run.config_file}", f"--workdir={run.workdir}",
          *(f"--config.{k}={_format(v)}" for k, v in run.overrides)]
