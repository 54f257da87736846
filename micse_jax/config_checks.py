"""Everything about a training config that can be checked before a model is built or compiled.

`check_config(config)` needs nothing but the config: types and ranges (the `RULES` table),
constraints between fields, the methods' parts and how they combine (`check_methods`), the
population's fields (`check_population`, by `configs/population_fields.PER_MEMBER`), the optional
packages. The sweep runs it for every run before any starts. `check_run(config, workdir)` runs
it once more with the file-system checks: the SentEval directory when dev selection is on, a
writable workdir, and, for a workdir that already holds checkpoints, a `config.json` compatible
with the new config (`resume_checks.py`: which fields may change on resume, and the line a change
that alters the steps left says). `check_chunk_size` needs the devices: `training/run_inputs.prepare_runs`
and `training/program.build` run it. `micse-train` adds `check_command_line` (a member field given on the command
line that the population replaces). The checks that need the checkpoint run in
`training/run_inputs.prepare`. Every failure is a `ConfigError`: one line, nothing written.

The choice lists these checks read are owned below the training package (`configs/methods.py`,
`augmentation/add.py`, `models/`, `losses/ami.py`, `data/pipeline.py`, `configs/population_fields.py`):
this module imports nothing from `micse_jax.training`, which imports it.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import ml_collections

from micse_jax import caches, paths
from micse_jax.augmentation.add import ADD_IMPORTANCE, ADD_MODES
from micse_jax.configs import population_fields
from micse_jax.configs.methods import OBJECTIVES, VIEW_KINDS
from micse_jax.data.pipeline import SHUFFLE_SCHEMES
from micse_jax.errors import ConfigError
from micse_jax.evaluation import senteval_data
from micse_jax.losses.ami import AMI_VARIANTS
from micse_jax.models.dropout import RNG_IMPLS
from micse_jax.models.dtypes import DTYPES
from micse_jax.models.policy import ATTENTION_MODES
from micse_jax.models.remat import REMAT_POLICIES
from micse_jax.optional import require
from micse_jax.resume_checks import check_resume_compatible, config_differences  # noqa: F401  (re-exported)


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(lo: int, hi: float = math.inf) -> Callable[[Any], str | None]:
  def check(v):
    if not _is_int(v):
      return f"must be an integer, got {v!r}"
    if lo <= v <= hi:
      return None
    return f"must be >= {lo}, got {v}" if hi == math.inf else f"must be in [{lo}, {hi}], got {v}"
  return check


def _real(lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False):
  def check(v):
    if not _is_number(v):
      return f"must be a finite number, got {v!r}"
    if (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi):
      return None
    if hi == math.inf:
      return f"must be {'>' if lo_open else '>='} {lo}, got {v}"
    return f"must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, got {v}"
  return check


def _bool(v):
  return None if isinstance(v, bool) else f"must be True or False, got {v!r}"


def _text(v):
  return None if isinstance(v, str) and v.strip() else f"must be a non-empty string, got {v!r}"


def _auto_or_positive(v):
  """"auto" or an integer >= 1, as text (`--config.steps_per_dispatch=8` gives "8") or an int."""
  text = str(v)
  return None if text == "auto" or text.isdigit() and int(text) >= 1 else f"must be auto or an integer >= 1, got {v!r}"


def _auto_or_count(v):
  """"auto" or an integer >= 0, as text (`--config.chunk_size=128` gives "128") or an int."""
  text = str(v)
  return None if text == "auto" or text.isdigit() else f"must be auto or an integer >= 0, got {v!r}"


def _choice(*allowed):
  return lambda v: None if v in allowed else f"must be one of {', '.join(allowed)}, got {v!r}"


RULES: dict[str, Callable[[Any], str | None]] = {
    "seed": _int(0),
    "num_train_steps": _int(1),
    "batch_size": _int(2),  # InfoNCE needs at least one in-batch negative
    "log_every": _int(1),
    "checkpoint_every": _int(1),
    "keep_checkpoints": _int(1),
    "eval_every": _int(0),
    "steps_per_dispatch": _auto_or_positive,  # training/dispatch.py
    "chunk_size": _auto_or_count,  # training/grad_cache.py (0: the whole batch), training/chunk_choice.py (auto)
    "model.name_or_path": _text,
    "model.max_length": _int(2),  # [CLS] and [SEP]
    "model.dtype": _choice(*DTYPES),
    "model.loss_scale_init": _real(0, lo_open=True),  # float16 dynamic loss scaling (precision.py)
    "model.loss_scale_period": _int(1),
    "model.attention": _choice(*ATTENTION_MODES),
    "model.remat": _choice(*REMAT_POLICIES),
    "mesh.shard_state": lambda v: None if v is None else _bool(v),  # None: chosen by the devices
    "mesh.shard_update": _bool,
    "mesh.shard_min_elements": _int(1),
    "mesh.cuda_graphs": _choice("auto", "kernels", "xla", "fixed", "none"),  # training/xla_options.CUDA_GRAPHS
    "model.dropout_random_bits": lambda v: None if v in (16, 32) else f"must be 16 or 32, got {v!r}",
    "model.rng_impl": _choice(*RNG_IMPLS),
    "data.corpus": _text,
    "data.num_sentences": _int(0),
    "data.subset_seed": _int(0),
    "data.shuffle": _choice(*SHUFFLE_SCHEMES),
    "data.prefetch": _int(0),
    "optim.learning_rate": _real(0, lo_open=True),
    "optim.warmup_steps": _int(0),
    "optim.weight_decay": _real(0),
    "optim.b1": _real(0, 1, hi_open=True),
    "optim.b2": _real(0, 1, hi_open=True),
    "optim.eps": _real(0, lo_open=True),
    "optim.grad_clip_norm": _real(0),
    "loss.temperature": _real(0, lo_open=True),
    "ami.enabled": _bool,
    "ami.weight": _real(0),
    "ami.num_samples": _int(1),
    "ami.heads_per_slice": _int(1),
    "ami.pool_layers": _bool,
    "ami.require_positive": _bool,
    "momentum.enabled": _bool,
    "momentum.decay": _real(0, 1),
    "momentum.dropout": _real(0, 1, hi_open=True),
    "momentum.queue_size": _int(0),
    "momentum.mask_same_sentence": _bool,
    "eval.sickr_dev": _bool,
    "eval.batch_size": _int(1),
    "eval.transfer_protocol": _choice(*senteval_data.TRANSFER_PROTOCOLS),
    "mlm.weight": _real(0),
    "mlm.prob": _real(0, 1, lo_open=True, hi_open=True),
    "reconstruction.weight": _real(0),
    "infocse.weight": _real(0),
    "infocse.mask_prob": _real(0, 1, lo_open=True, hi_open=True),
    "analysis.num_sentences": _int(2),  # uniformity needs pairs
    "cache.dir": caches.check_cache_dir,
    "cache.compilation": _bool,
    "cache.compilation_max_size": caches.check_max_size,
    "cache.tokenized": _bool,
}


def _get(config: ml_collections.ConfigDict, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def _has(config: ml_collections.ConfigDict, dotted: str) -> bool:
  try:
    _get(config, dotted)
    return True
  except (KeyError, AttributeError):
    return False


def check_fields(config: ml_collections.ConfigDict) -> None:
  """Type and range of every numeric/boolean/string field in `RULES` (absent ones are skipped)."""
  problems = []
  for field, rule in RULES.items():
    if _has(config, field):
      problem = rule(_get(config, field))
      if problem:
        problems.append(f"{field} {problem}")
  if problems:
    raise ConfigError("invalid config: " + "; ".join(problems))


def check_combinations(config: ml_collections.ConfigDict) -> None:
  """Constraints between fields: queue vs batch, AMI layers, task names. (Any batch runs on any
  device count: the trainer pads it with masked rows, `training/data_parallel.py: padded_batch_size`.)"""
  if config.momentum.enabled and config.batch_size > config.momentum.queue_size:
    raise ConfigError(f"momentum.queue_size {config.momentum.queue_size} must be >= batch_size "
                      f"{config.batch_size}")
  if config.ami.enabled:
    layers = config.ami.layers
    if (not isinstance(layers, (tuple, list)) or not layers
        or not all(_is_int(i) for i in layers)):
      raise ConfigError(f"ami.layers must be a non-empty tuple of layer indices, e.g. (-4,-3,-2,-1); "
                        f"got {layers!r}")
  _final_tasks(config)


def _final_tasks(config: ml_collections.ConfigDict) -> list[str]:
  if not config.eval.final_tasks:
    return []
  try:
    return senteval_data.resolve_tasks(config.eval.final_tasks)
  except ValueError as e:
    raise ConfigError(f"eval.final_tasks: {e}") from e


class MethodConfigError(ConfigError):
  """A config asks for an unknown method part or a combination the trainer cannot run."""


def _one_of(name: str, value, allowed) -> None:
  if value not in allowed:
    raise MethodConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise MethodConfigError(message)


def _check_view(config) -> None:
  v = config.view
  if v.kind == "add":
    _one_of("view.add_importance", v.add_importance, tuple(ADD_IMPORTANCE))
    _one_of("view.add_mode", v.add_mode, ADD_MODES)
    _require(v.add_threshold > 2, f"view.add_threshold={v.add_threshold} must be > 2 (ADD uses t in 8, 10, 12): "
             "with t <= 2 even [CLS] x [SEP] sentences would lose tokens")
    if v.add_mode == "static":
      _require(1 <= v.add_k <= 3, f"view.add_k={v.add_k} must be 1, 2 or 3 for static ADD")
    _require(not config.ami.enabled, "ami.enabled with view.kind='add': AMI compares attention cell by cell, "
             "but ADD removes tokens from view 2, so the two views' attention maps do not align")
  if v.kind == "span_mask":
    _require(v.span_length >= 1, f"view.span_length={v.span_length} must be >= 1")


def check_methods(config) -> None:
  """The method fields of `configs/methods.py` (views, terms) and how they combine."""
  _one_of("loss.objective", config.loss.objective, OBJECTIVES)
  _one_of("view.kind", config.view.kind, VIEW_KINDS)
  _one_of("ami.variant", config.ami.variant, AMI_VARIANTS)
  _check_view(config)
  if config.ami.enabled and config.ami.variant == "official":
    _require(len(config.ami.layers) % 2 == 0, f"ami.variant='official' pairs layers by parity; "
             f"ami.layers={tuple(config.ami.layers)} must name an even number of layers")
  if config.ct.enabled:
    _require(not config.momentum.enabled, "ct.enabled with momentum.enabled: Contrastive Tension's second "
             "encoder is trained, not an EMA; turn momentum off")
    _require(config.view.kind == "dropout",
             f"ct.enabled with view.kind={config.view.kind!r}: CT's views are the two encoders")
  if config.loss.objective == "positive_only":
    _require(not config.momentum.enabled, "loss.objective='positive_only' has no negatives, "
             "so a momentum queue of negatives is meaningless; set momentum.enabled=False")
  if config.infocse.enabled:
    _require(config.infocse.num_layers >= 1, f"infocse.num_layers={config.infocse.num_layers} must be >= 1")
    _require(0 <= config.infocse.pretrain_steps < config.num_train_steps,
             f"infocse.pretrain_steps={config.infocse.pretrain_steps} must be in [0, num_train_steps)")


def check_senteval(config: ml_collections.ConfigDict) -> None:
  """With dev selection on, a SentEval dir that exists must hold STS-B dev (and the final tasks).

  A missing default dir only disables selection (with a warning, see `evaluation.evaluators.dev_selection.DevSelection`); a missing
  dir that the config names explicitly is an error.
  """
  directory = config.eval.senteval_dir
  if config.eval_every <= 0 and not config.eval.final_tasks:
    return
  if not directory or not os.path.isdir(directory):
    if directory and os.path.abspath(directory) == os.path.abspath(paths.senteval_dir()):
      return
    raise ConfigError(f"eval.senteval_dir not found: {directory!r} (set eval_every=0 and "
                      "eval.final_tasks='' to train without SentEval)")
  tasks = _final_tasks(config)
  if config.eval_every > 0:
    tasks = ["STSBenchmark"] + (["SICKRelatedness"] if config.eval.sickr_dev else []) + tasks
  try:
    senteval_data.validate_tasks(directory, list(dict.fromkeys(tasks)))
  except senteval_data.SentEvalDataError as e:
    raise ConfigError(f"eval.senteval_dir: {e}") from e


def check_chunk_size(value, rows: int, row_devices: int) -> None:
  """A numeric `chunk_size` (GradCache's global rows per block; 0 and `rows` are the whole batch) must
  divide the `rows` of the padded global batch (`data_parallel.padded_batch_size`) and be a multiple of
  the `row_devices` its rows are split over (`population_placement.row_devices`): each device cuts its
  own rows into blocks of the same size. "auto" is chosen later, for the devices' memory."""
  text = str(value).strip()
  if text == "auto" or not text.isdigit():
    return
  size = int(text)
  if size in (0, rows) or (size < rows and rows % size == 0 and size % row_devices == 0):
    return
  fits = [str(d) for d in range(row_devices, rows, row_devices) if rows % d == 0]
  shown = ", ".join(["0"] + (fits if len(fits) <= 12 else fits[:6] + ["..."] + fits[-5:]))
  raise ConfigError(f"chunk_size={size} must divide the padded global batch of {rows} rows and be a multiple of "
                    f"the {row_devices} device(s) its rows are split over; choose one of {shown} (0: the whole "
                    "batch) or auto")


def check_workdir_writable(workdir: str) -> None:
  """The workdir (or its nearest existing parent) must be a writable directory."""
  if not workdir:
    raise ConfigError("--workdir must not be empty")
  path = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f"workdir exists and is not a directory: {path}")
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f"workdir is not writable: {path} ({existing} does not allow writing)")


def check_population(config: ml_collections.ConfigDict) -> None:
  """The `population.*` fields (`configs/population_fields.PER_MEMBER`): each value passes its member field's
  own rule (`RULES`), one per member (or none), distinct seeds, and what they combine with."""
  if "population" not in config:
    return
  group, k = config.population, population_fields.size(config)
  for name, spec in population_fields.PER_MEMBER.items():
    value = group.get(name, () if spec.per_member else 0)
    if spec.per_member and not isinstance(value, (tuple, list)):
      raise ConfigError(f"population.{name} must be a tuple of one {spec.field} per member, e.g. '(1,2,3)'; "
                        f"got {value!r}")
    problem = next(filter(None, map(RULES[spec.field], value if spec.per_member else (value,))), None)
    if problem:
      raise ConfigError(f"population.{name}: each value is a member's {spec.field} and {problem}")
    if value and not k:
      raise ConfigError(f"population.{name} is set without members: the fields of a population need population.seeds")
    if spec.per_member and value and len(value) != k:
      raise ConfigError(f"population.{name} has {len(value)} entries, population.seeds {k}: give one {spec.field} "
                        "per member (or none)")
  if len(set(group.seeds)) != len(group.seeds):
    raise ConfigError(f"population.seeds must be distinct, got {tuple(group.seeds)!r}")
  if group.get("ami_weights") and not config.ami.enabled:
    raise ConfigError("population.ami_weights needs ami.enabled=True")
  for field in ("shard_state", "shard_update"):
    if k and config.mesh.get(field):
      raise ConfigError(f"population training keeps every member's state whole; mesh.{field}=True is "
                        "not supported with population.seeds")


def check_command_line(config: ml_collections.ConfigDict, overridden) -> None:
  """A field given on the command line (`overridden`: dotted names) that a set `population.*` field
  replaces in every member would be silently replaced: one error line instead."""
  for name in population_fields.set_fields(config):
    field = population_fields.PER_MEMBER[name].field
    if field in overridden:
      raise ConfigError(f"--config.{field} is replaced in every member by population.{name} "
                        f"({config.population[name]!r}); give the members' values there, or leave out "
                        "population.seeds for a solo run")


def check_packages(config: ml_collections.ConfigDict) -> None:
  """The optional packages this config's paths need are installed (`micse_jax/optional.py`)."""
  from micse_jax.models.dtypes import dtype_name
  if dtype_name(config) == "float16":
    require("jmp", "float16 training (model.dtype=float16, dynamic loss scaling)")


def check_config(config: ml_collections.ConfigDict) -> None:
  """Every check that needs only the config (the sweep's pre-check runs this for each run)."""
  check_fields(config)
  check_combinations(config)
  check_methods(config)
  check_population(config)
  check_packages(config)


def check_run(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """All checks that need no model: call before anything is loaded, built or written. Returns the
  lines a resume with a changed field says once resumed (`resume_checks.resume_notes`; [] for none)."""
  check_config(config)
  check_workdir_writable(workdir)
  notes = check_resume_compatible(config, workdir)
  check_senteval(config)
  return notes
