"""Sweep configs and their expansion into runs (the grid of a few-shot / ablation study).

A sweep config (`configs/sweeps/*.py`, `get_config(arg)`) is an ml_collections ConfigDict:

    name             study name (default sweep directory: runs/sweeps/<name>)
    base_config      training config used when there is no `method` axis ("micse", or a file)
    overrides        ((field, value), ...) applied to every run
    axes             ((key, (value, ...)), ...), expanded as a Cartesian product in this order
    num_train_steps  held constant across sizes (the paper's protocol); an axis may override it
    eval_tasks       `eval.final_tasks` of every run ("sts", "all", "STSBenchmark,...")
    step_ms          optional: assumed milliseconds per training step, for `--dry_run`'s GPU-hours
    step_ms_batch    optional: the batch `step_ms` is for; each run's step then takes step_ms × its
                     batch_size / step_ms_batch (a sweep over the batch size)
    step_ms_note     optional: where that figure comes from (printed with the estimate)

Axis keys: `method` (a packaged config's name, e.g. `simcse`, or `path.py[:variant]`), `seed` (sets `seed`
and `data.subset_seed` together), or any training-config field such as `data.num_sentences`
(absolute sizes; a float in (0, 1] is a fraction of the corpus, 0 means all of it),
`ami.weight`, `batch_size`, `model.name_or_path`.

A *zipped* axis moves several fields together, one tuple of values per point:
`(("data.num_sentences", "ami.weight", "num_train_steps"), ((1000, 1e-3, 8000), (10000, 1e-4, 7850)))`
is two points of one axis, not a 2 × 2 × 2 product (per-size hyper-parameters, e.g. the official
miCSE recipe's λ and epochs per split). The first key names the run (workdir, tables); the others
are overrides that follow it. `method` and `seed` cannot be zipped.

Each run gets a workdir named by its axis values, e.g. `method=simcse__data.num_sentences=64__seed=0`,
and is an ordinary `python -m micse_jax.main --config FILE --workdir DIR --config.<field>=<value> ...`.

`group_populations(runs, K)` (`micse-sweep --population_size K`) trains runs that differ only in
their seeds (`POPULATION_FIELDS`) as populations of up to K members (`training/population.py`):
one program `...__seeds=(0,1,2)` whose member folders `members/<i>/` are the grouped runs'
workdirs for the report. `--population_size auto` (the default) chooses K per group from the
device memory (`studies/population_size.py`).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import os
import re
import sys

import ml_collections

from micse_jax import configs
from micse_jax.errors import ConfigError, MicseError

# The config checks, corpora, models and tokenizers (JAX, Flax, TFDS, transformers) are imported in
# the functions that check a sweep's runs, so that reading a sweep (its plan, its report) stays light.

SPECIAL_AXES = ("method", "seed")
POPULATION_FIELDS = ("seed", "data.subset_seed")  # what may differ between the members of a population


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
  """`get_config(arg)` of `path.py[:arg]`: a file, else a packaged config (`micse_jax.configs.resolve`)."""
  try:
    path, _, arg = configs.resolve(spec).partition(":")
  except ConfigError as e:
    raise SweepError(str(e)) from e
  full = os.path.abspath(path)
  module_spec = importlib.util.spec_from_file_location(f"_sweep_cfg_{abs(hash(full))}", full)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or arg_default)


def method_config_file(method: str) -> str:
  """'simcse' → 'simcse' (a packaged config's name); a 'path.py[:variant]' is kept as written."""
  return method


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
                       f"of {source} (see micse_jax/configs/default.py)")
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


def _axis_keys(key) -> tuple[str, ...]:
  """An axis key as a tuple of field names: one for a plain axis, several for a zipped one."""
  return tuple(str(k) for k in key) if isinstance(key, (list, tuple)) else (str(key),)


def _check_zipped(sweep_name: str, keys: tuple[str, ...], values: tuple) -> None:
  """A zipped axis: ≥ 2 keys, neither `method` nor `seed`, every point a tuple of len(keys) values."""
  if len(keys) < 2:
    raise SweepError(f"sweep {sweep_name!r}: a zipped axis needs at least two keys, got {keys}")
  special = [k for k in keys if k in SPECIAL_AXES]
  if special:
    raise SweepError(f"sweep {sweep_name!r}: axis {special[0]!r} cannot be zipped with other fields")
  for point in values:
    if not isinstance(point, (list, tuple)) or len(point) != len(keys):
      raise SweepError(f"sweep {sweep_name!r}: zipped axis {keys} needs {len(keys)} values per point, "
                       f"got {point!r}")


def validate_sweep(sweep: ml_collections.ConfigDict) -> list[tuple[tuple[str, ...], tuple]]:
  """Checks the axes' shape (non-empty, no duplicates, zipped points complete).

  Returns a list of (keys, points): keys is a tuple of field names (one for a plain axis), and
  each point is a tuple of len(keys) values.
  """
  axes = []
  for key, values in sweep.axes:
    keys = _axis_keys(key)
    values = tuple(values) if isinstance(values, (list, tuple)) else (values,)
    if isinstance(key, (list, tuple)):  # zipped
      _check_zipped(sweep.name, keys, values)
      axes.append((keys, tuple(tuple(point) for point in values)))
    else:
      axes.append((keys, tuple((value,) for value in values)))
  all_keys = [k for keys, _ in axes for k in keys]
  for keys, points in axes:
    name = keys[0] if len(keys) == 1 else keys
    if not points:
      raise SweepError(f"sweep {sweep.name!r}: axis {name!r} is empty")
    for k in keys:
      if all_keys.count(k) > 1:
        raise SweepError(f"sweep {sweep.name!r}: axis {k!r} appears twice")
    if len(set(_format(p[0]) for p in points)) != len(points):
      raise SweepError(f"sweep {sweep.name!r}: axis {name!r} repeats a value: {[p[0] for p in points]}")
  if "seed" in all_keys and "data.subset_seed" in all_keys:
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
      from micse_jax.data.prepared import corpus_size
      try:
        sizes_cache[corpus] = corpus_size(corpus)
      except MicseError as e:
        raise SweepError(str(e)) from e
    return max(1, int(round(value * sizes_cache[corpus])))
  return int(value)


def expand(sweep: ml_collections.ConfigDict, sweep_dir: str) -> list[RunSpec]:
  """All runs of the sweep, in axis order; every override checked against its config first."""
  axes = validate_sweep(sweep)
  sizes_cache: dict = {}
  runs, loaded = [], {}
  for combo in itertools.product(*(points for _, points in axes)):
    labels = tuple((keys[0], point[0]) for (keys, _), point in zip(axes, combo))
    followers = [(k, v) for (keys, _), point in zip(axes, combo) for k, v in zip(keys[1:], point[1:])]
    values = dict(labels)
    config_file = method_config_file(str(values["method"])) if "method" in values else sweep.base_config
    if config_file not in loaded:
      loaded[config_file] = load_config_file(config_file)
    config = copy.deepcopy(loaded[config_file])  # keeps FieldReferences: derived fields follow overrides
    overrides = list(sweep.overrides) + [("num_train_steps", sweep.num_train_steps),
                                         ("eval.final_tasks", sweep.eval_tasks)]
    for key, value in labels:
      if key == "seed":
        overrides += [("seed", int(value)), ("data.subset_seed", int(value))]
      elif key != "method":
        overrides.append((key, value))
    overrides += followers
    overrides = list(dict(overrides).items())  # a later setting of a field wins
    for key, value in overrides:
      if key != "data.num_sentences":
        set_field(config, key, value, config_file)
    if "data.num_sentences" in dict(overrides):  # fractions need the (overridden) corpus
      resolved = _resolve_size(dict(overrides)["data.num_sentences"], config.data.corpus, sizes_cache)
      overrides = [(k, resolved if k == "data.num_sentences" else v) for k, v in overrides]
      set_field(config, "data.num_sentences", resolved, config_file)
    _check_run_config(config.copy_and_resolve_references(), config_file)
    name = _safe("__".join(f"{k}={_format(v)}" for k, v in labels)) or "run"
    runs.append(RunSpec(name=name, config_file=config_file, overrides=tuple(overrides), labels=labels,
                        workdir=os.path.join(sweep_dir, name)))
  return runs


def _check_run_config(config: ml_collections.ConfigDict, source: str) -> None:
  """All the trainer's config checks (`config_checks.check_config`), before any run starts."""
  from micse_jax import config_checks
  try:
    config_checks.check_config(config)
  except ConfigError as e:
    raise SweepError(f"{source} with the sweep's overrides: {e}") from e


def check_data(runs: list[RunSpec]) -> None:
  """Prepared corpora must match each run's tokenizer and max_length (SweepError otherwise)."""
  from micse_jax.data import prepared
  seen = set()
  for run in runs:
    config = load_config_file(run.config_file)
    for key, value in run.overrides:
      set_field(config, key, value, run.config_file)
    corpus, model, length = config.data.corpus, config.model.name_or_path, config.model.max_length
    if (corpus, model, length) in seen or not os.path.isdir(corpus):
      continue
    seen.add((corpus, model, length))
    from micse_jax.models.loading import resolve_model_dir
    from micse_jax.tokenization import Tokenizer
    try:
      rows = prepared.PreparedRows(corpus)
      prepared.check_compatible(rows.metadata, corpus, Tokenizer.from_pretrained(resolve_model_dir(model)), length)
    except (MicseError, ValueError, FileNotFoundError) as e:  # the tokenizer raises ValueError
      raise SweepError(f"run {run.name}: {e}") from e


def _portable_config(config_file: str) -> str:
  """A config file that exists here as an absolute path (a job may start elsewhere); a packaged
  config's name as it is (the job's own installed micse_jax resolves it)."""
  path, sep, variant = config_file.partition(":")
  return os.path.abspath(path) + sep + variant if os.path.isfile(path) else config_file


def main_command(run: RunSpec, python: str = sys.executable) -> list[str]:
  """The `python -m micse_jax.main` command line of a run (no cwd or PYTHONPATH needed)."""
  return [python, "-m", "micse_jax.main", f"--config={_portable_config(run.config_file)}",
          f"--workdir={run.workdir}",
          *(f"--config.{k}={_format(v)}" for k, v in run.overrides)]


def estimated_gpu_hours(runs: list[RunSpec], step_ms: float, gpus_per_run: int = 1,
                        done_steps: dict | None = None, population_step_ms: dict | None = None,
                        step_ms_batch: int | None = None) -> tuple[int, float]:
  """(training steps left, GPU-hours) of `runs` at `step_ms` milliseconds per step.

  GPU-hours = Σ_runs (num_train_steps - steps already checkpointed, from `done_steps` by run
  name) × step_ms / 3.6e6 × gpus_per_run: training steps only (the STS-B dev evaluations every
  `eval_every` steps and the final STS suite are not counted). A population of K members
  (`population_size_of`) takes `population_step_ms[K]` per step when given (a measured
  figure), else K × `step_ms` (no speed-up assumed). With `step_ms_batch`, those figures are for
  that batch and a run's step takes them × its `batch_size` / `step_ms_batch` (a step's work is
  linear in its rows).
  """
  if step_ms <= 0:
    raise SweepError(f"step time must be > 0 ms, got {step_ms}")
  if step_ms_batch is not None and step_ms_batch <= 0:
    raise SweepError(f"step_ms_batch must be > 0, got {step_ms_batch}")
  done_steps, population_step_ms = done_steps or {}, population_step_ms or {}
  steps, ms = 0, 0.0
  for run in runs:
    k, left = population_size_of(run), max(int(run.override("num_train_steps")) - done_steps.get(run.name, 0), 0)
    scale = 1.0 if step_ms_batch is None else int(run.override("batch_size")) / step_ms_batch
    steps += left
    ms += left * scale * (step_ms if k == 1 else population_step_ms.get(k, k * step_ms))
  return steps, ms / 3.6e6 * gpus_per_run


def population_run(chunk: list[RunSpec], sweep_dir: str) -> RunSpec:
  """One population run training the runs of `chunk` (same overrides but their seeds) as members, its
  config checked as the trainer checks it (`SweepError` when it refuses the population)."""
  first = chunk[0]
  shared = [(k, v) for k, v in first.overrides if k not in POPULATION_FIELDS]
  overrides = shared + [("population.seeds", tuple(int(r.override("seed")) for r in chunk))]
  if all(r.override("data.subset_seed") is not None for r in chunk):
    overrides.append(("population.subset_seeds", tuple(int(r.override("data.subset_seed")) for r in chunk)))
  seeds = tuple(r.label("seed", r.override("seed")) for r in chunk)
  labels = tuple((k, v) for k, v in first.labels if k != "seed") + (("seeds", seeds),)
  name = _safe("__".join(f"{k}={_format(v)}" for k, v in labels))
  config = load_config_file(first.config_file)
  for key, value in overrides:
    set_field(config, key, value, first.config_file)
  _check_run_config(config.copy_and_resolve_references(), first.config_file)
  return RunSpec(name=name, config_file=first.config_file, overrides=tuple(overrides), labels=labels,
                 workdir=os.path.join(sweep_dir, name))


def population_groups(runs: list[RunSpec]) -> list[list[RunSpec]]:
  """The runs that differ only in `POPULATION_FIELDS`, in sweep order (a run without a `seed`
  override is a group of its own: it has no seed to vary)."""
  groups: dict = {}
  for i, run in enumerate(runs):
    unseeded = run.override("seed") is None
    key = (run.config_file, tuple((k, _format(v)) for k, v in run.overrides if k not in POPULATION_FIELDS),
           i if unseeded else None)
    groups.setdefault(key, []).append(run)
  return list(groups.values())


def group_populations(runs: list[RunSpec], size, sweep_dir: str) -> tuple[list[RunSpec], list[RunSpec]]:
  """(runs to launch, runs to report): each group of `population_groups` split, in sweep order,
  into populations of up to `size` members (an int, or a dict {a group's first run's name: K}, as
  `--population_size auto` chooses per group); a reported run's workdir becomes its member folder
  `<population workdir>/members/<i>`. `size` 1: unchanged."""
  sizes = size if isinstance(size, dict) else None
  for k in (sizes if sizes is not None else {"": size}).values():  # {}: no group sized (a report, nothing launched)
    if k < 1:
      raise SweepError(f"--population_size must be >= 1, got {k}")
  if size == 1:
    return list(runs), list(runs)
  launched, members = [], {}
  for group in population_groups(runs):
    k = sizes.get(group[0].name, 1) if sizes is not None else size
    for start in range(0, len(group), k):
      chunk = group[start:start + k]
      if len(chunk) == 1:
        launched += chunk
        continue
      population = population_run(chunk, os.path.dirname(chunk[0].workdir))
      launched.append(population)
      for i, run in enumerate(chunk):
        members[run.name] = dataclasses.replace(run, workdir=os.path.join(population.workdir, "members", str(i)))
  return launched, [members.get(run.name, run) for run in runs]


def population_size_of(run: RunSpec) -> int:
  """Members a run trains (1 for a solo run)."""
  return len(run.override("population.seeds", ()) or ()) or 1
