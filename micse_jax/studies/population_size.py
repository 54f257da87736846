"""`micse-sweep --population_size auto`: the largest population of each group of runs that fits the device.

A group is the runs of a sweep that differ only in their seeds (`spec.population_groups`). Its K
is the largest K ≤ the group's size whose compiled population step (the trainer's program,
`aot/compile.compile_program`, with the group's own config: model, batch size, max length,
dtype, objective) needs at most `use` × the device memory a run may use, per device, by the
compiler's memory analysis (`aot/compile.memory(compiled)['peak']`, what `bench --aot` reports).

The device: a named target (`--population_target h100`, compiled deviceless; memory: the target's
`device_memory_size` × JAX's GPU memory fraction), this machine's accelerator (its
`bytes_limit`), or any device with `--population_device_gib` (also a CPU: how the tests run the
whole path). With none of these (a CPU and no target) K is 1: one program per run, as before.

Few compiles: memory is near-linear in K, so K = 1 and 2 give a line, its prediction is compiled
and the line re-drawn through the last measurement until the largest fitting K is bracketed
(`choose`; typically 3 compiles). The measured peaks are cached in `<sweep_dir>/population_size.json`
by config, device and jax version, with the chosen sizes (which `--report` reads).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import time
from typing import Callable

from micse_jax.studies import spec
from micse_jax.studies.spec import SweepError

GIB = 2 ** 30
JAX_GPU_MEMORY_FRACTION = 0.75  # JAX's default XLA_CLIENT_MEM_FRACTION: what a GPU run may use
CACHE_FILE = "population_size.json"
MAX_COMPILES = 6  # per measured config
# Config fields that do not change the step's shapes or buffers: configs differing only here share a measurement.
NEUTRAL_FIELDS = ("seed", "population", "data", "eval", "eval_every", "log_every", "checkpoint_every",
                  "keep_checkpoints", "num_train_steps", "optim.learning_rate", "ami.weight")


@dataclasses.dataclass(frozen=True)
class Device:
  """Where the runs will train: the devices to compile for, the bytes per device a run may use, and
  how that figure is known (for the plan)."""
  devices: tuple
  capacity: int
  name: str
  source: str


@dataclasses.dataclass(frozen=True)
class Choice:
  """A group's K and why: the peaks measured (bytes per device by K) and the budget they met."""
  k: int
  group: str
  reason: str
  peaks: dict = dataclasses.field(default_factory=dict)
  compiles: int = 0
  seconds: float = 0.0


def parse_size(text: str) -> int | None:
  """`--population_size`: an integer ≥ 1, or None for 'auto'; SweepError otherwise."""
  if text.strip().lower() == "auto":
    return None
  try:
    k = int(text)
  except ValueError:
    k = 0
  if k < 1:
    raise SweepError(f"--population_size must be an integer >= 1 or 'auto', got {text!r}")
  return k


def gib(n: float) -> str:
  """Bytes as GiB for the plan."""
  return f"{n / GIB:.2f} GiB"


# ---------------------------------------------------------------- the rule


def _predict(p1: int, k: int, pk: int, budget: int, limit: int) -> int:
  """The largest K on the line through (1, p1) and (k, pk) with peak ≤ budget, in [1, limit]."""
  slope = max((pk - p1) / (k - 1), 1.0)
  return max(1, min(limit, 1 + math.floor((budget - p1) / slope)))


def choose(peak_of: Callable[[int], int], limit: int, budget: int,
           max_compiles: int = MAX_COMPILES) -> tuple[int, dict]:
  """(the largest K ≤ `limit` found with `peak_of(K)` ≤ `budget`, the peaks measured by K).

  K = 1 first (SweepError if even one run does not fit), then K = 2, then the line's prediction
  through (1, peak 1) and the last K measured, kept strictly between the largest K known to fit
  and the smallest known not to, until they meet, the line predicts no larger K, or
  `max_compiles` peaks are measured. The K returned was measured to fit.
  """
  peaks = {1: peak_of(1)}
  if peaks[1] > budget:
    raise SweepError(f"one run's step needs {gib(peaks[1])} per device, more than the budget of "
                     f"{gib(budget)}: it does not fit even alone (lower batch_size or model.max_length, "
                     "or use a device with more memory)")
  fit, no_fit, probe = 1, limit + 1, min(2, limit)
  while fit + 1 < no_fit and len(peaks) < max_compiles and probe > fit:
    peaks[probe] = peak_of(probe)
    if peaks[probe] <= budget:
      fit = probe
    else:
      no_fit = probe
    probe = min(_predict(peaks[1], probe, peaks[probe], budget, limit), no_fit - 1)
  return fit, peaks


# ---------------------------------------------------------------- the device


@contextlib.contextmanager
def _no_preallocation():
  """JAX's GPU backend started without grabbing 75 % of the memory (the runs need it), the
  environment restored for the runs this process starts."""
  before = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  try:
    yield
  finally:
    if before is None:
      os.environ.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    else:
      os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = before


def start_backend(target: str | None) -> None:
  """Starts JAX's backend in the sweep's process before anything else does (the config checks
  resolve `model.dtype=auto`): for a `target`, the CPU only (the target is compiled for
  deviceless; this machine's GPU is left alone), else without preallocating a GPU's memory,
  which the runs this process starts need."""
  import jax
  if target:
    jax.config.update("jax_platforms", "cpu")
  with _no_preallocation():
    jax.local_devices()


def local_device(capacity_gib: float | None = None) -> Device | None:
  """This machine's devices: an accelerator's `bytes_limit` (the least over its devices), or
  `capacity_gib` on any device; None on a CPU without `capacity_gib`."""
  import jax
  with _no_preallocation():
    devices = tuple(jax.local_devices())
  kind = f"{len(devices)} × {devices[0].device_kind}"
  if capacity_gib is not None:
    return Device(devices, int(capacity_gib * GIB), kind, f"--population_device_gib {capacity_gib:g}")
  if devices[0].platform == "cpu":
    return None
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
  if not all(limits):
    return None
  return Device(devices, min(limits), kind, f"this machine's bytes_limit per device, {gib(min(limits))}")


def target_device(target: str, num_devices: int, capacity_gib: float | None = None) -> Device:
  """`num_devices` devices of a named target (`aot/topology.py`), compiled for deviceless on this CPU
  (`start_backend(target)` first);
  the capacity: `capacity_gib`, else a GPU's `device_memory_size` × the memory fraction JAX gives a
  run (`gpu_memory_fraction`). A TPU target needs `capacity_gib`."""

  from micse_jax.aot import topology
  from micse_jax.errors import ConfigError
  if target not in topology.TARGETS:
    raise SweepError(f"unknown --population_target {target!r}; expected one of {', '.join(topology.TARGETS)}")
  total = topology.device_memory_bytes(target)
  if capacity_gib is None and total is None:
    raise SweepError(f"--population_target {target}: the TPU topology does not give the chip's memory; pass "
                     "--population_device_gib (the HBM a run may use per chip, e.g. 16 for a v5e)")
  try:
    devices = tuple(topology.target_devices(target, num_devices))
  except ConfigError as e:
    raise SweepError(str(e)) from e
  name = f"{num_devices} × {target} (compiled deviceless)"
  if capacity_gib is not None:
    return Device(devices, int(capacity_gib * GIB), name, f"--population_device_gib {capacity_gib:g}")
  variable, fraction = gpu_memory_fraction()
  return Device(devices, int(total * fraction), name, f"{target} device_memory_size {gib(total)} × {fraction:g} "
                f"({variable})")


def gpu_memory_fraction() -> tuple[str, float]:
  """(where it comes from, the fraction of a GPU's memory a JAX run may use): XLA_CLIENT_MEM_FRACTION
  or the deprecated XLA_PYTHON_CLIENT_MEM_FRACTION as set here (a run started by this sweep inherits
  it), else JAX's default 0.75."""
  for variable in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
    if os.environ.get(variable):
      try:
        return variable, float(os.environ[variable])
      except ValueError as e:
        raise SweepError(f"{variable}={os.environ[variable]!r} is not a fraction") from e
  return "JAX's default memory fraction", JAX_GPU_MEMORY_FRACTION


# ---------------------------------------------------------------- measuring a group


def run_config(run: spec.RunSpec):
  """A run's resolved training config (its config file with the sweep's overrides)."""
  config = spec.load_config_file(run.config_file)
  for key, value in run.overrides:
    spec.set_field(config, key, value, run.config_file)
  return config.copy_and_resolve_references()


def measurement_key(config, device: Device) -> str:
  """What a measured peak depends on: the config without `NEUTRAL_FIELDS`, the device, jax's version."""
  import jax
  flat = {}

  def walk(node, prefix):
    for k, v in node.items():
      name = f"{prefix}{k}"
      if any(name == f or name.startswith(f + ".") for f in NEUTRAL_FIELDS):
        continue
      if isinstance(v, dict):
        walk(v, name + ".")
      else:
        flat[name] = repr(v)
  walk(config.to_dict(), "")
  text = json.dumps({"config": flat, "device": device.name, "jax": jax.__version__}, sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def compiled_peak(config, device: Device, k: int) -> int:
  """Peak bytes per device of `config`'s K-member population step compiled for `device`."""
  from micse_jax.aot import compile as aot_compile
  from micse_jax.configs.population_fields import add_population_fields
  from micse_jax.errors import MicseError
  from micse_jax.models.loading import load_config, resolve_model_dir
  from micse_jax.tokenization import Tokenizer
  from micse_jax.training.networks import SpecialTokens
  c = config.copy_and_resolve_references()
  add_population_fields(c)  # none set: then K seeds
  c.population.seeds = tuple(range(k))
  try:
    model_dir = resolve_model_dir(c.model.name_or_path)
    bert_config = load_config(model_dir)
    tokens = SpecialTokens.from_tokenizer(Tokenizer.from_pretrained(model_dir), bert_config.vocab_size)
  except (MicseError, ValueError, OSError) as e:
    raise SweepError(f"--population_size auto: {e}") from e
  import jax
  try:
    compiled, _ = aot_compile.compile_program(c, bert_config, device.devices, tokens)
  except jax.errors.JaxRuntimeError as e:  # e.g. v100: CUDA 13's ptxas compiles nothing for sm_70
    raise SweepError(f"--population_size auto: the compiler refuses {device.name}: {str(e).splitlines()[0]}") from e
  return aot_compile.memory(compiled)["peak"]


class Cache:
  """`<sweep_dir>/population_size.json`: measured peaks by `measurement_key` and K, and the sizes chosen."""

  def __init__(self, sweep_dir: str):
    self.path = os.path.join(sweep_dir, CACHE_FILE)
    self.data = {"peaks": {}, "chosen": {}}
    if os.path.isfile(self.path):
      try:
        with open(self.path, encoding="utf-8") as f:
          self.data.update(json.load(f))
      except (ValueError, OSError) as e:
        raise SweepError(f"{self.path} is unreadable ({e}); delete it to measure again") from e

  def peaks(self, key: str) -> dict:
    """{K: peak bytes per device} measured for `key`."""
    return {int(k): int(v) for k, v in self.data["peaks"].get(key, {}).items()}

  def record(self, key: str, k: int, peak: int) -> None:
    """Adds one measurement and writes the file (an interrupted launch keeps what it compiled)."""
    self.data["peaks"].setdefault(key, {})[str(k)] = int(peak)
    self.save()

  def chosen(self) -> dict:
    """{a group's first run: K} of the last launch (what `--report` groups by)."""
    return dict(self.data["chosen"])

  def save(self, chosen: dict | None = None) -> None:
    """Writes the file atomically, with `chosen` as the sizes chosen when given."""
    if chosen is not None:
      self.data["chosen"] = dict(chosen)
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    with open(self.path + ".tmp", "w", encoding="utf-8") as f:
      json.dump(self.data, f, indent=1, sort_keys=True)
    os.replace(self.path + ".tmp", self.path)


def group_name(group: list) -> str:
  """A group's label in the plan: its first run's axis values without the seed."""
  labels = [f"{k}={spec._format(v)}" for k, v in group[0].labels if k != "seed"]
  return "__".join(labels) or group[0].name


def choose_for_group(group: list, device: Device, use: float, cache: Cache) -> Choice:
  """A group's K on `device` (peaks from `cache`, else compiled and cached)."""
  name, limit = group_name(group), len(group)
  if group[0].override("seed") is None:
    return Choice(1, name, "no seed override: nothing to vary between members")
  if limit == 1:
    return Choice(1, name, "one run in the group")
  refused = _refused_as_population(group)
  if refused:
    return Choice(1, name, refused)
  config = run_config(group[0])
  key, counter = measurement_key(config, device), {"compiles": 0, "seconds": 0.0}
  known = cache.peaks(key)  # every K measured for this config and device, by earlier groups or launches too

  def peak_of(k: int) -> int:
    if k not in known:
      start = time.perf_counter()
      known[k] = compiled_peak(config, device, k)
      counter["compiles"] += 1
      counter["seconds"] += time.perf_counter() - start
      cache.record(key, k, known[k])
    return known[k]
  budget = int(use * device.capacity)
  try:
    k, _ = choose(peak_of, limit, budget)
  except SweepError as e:
    raise SweepError(f"group {name} on {device.name}: {e} ({use:g} × {gib(device.capacity)}: {device.source})") from e
  return Choice(k, name, _reason(k, limit, known, budget, use, device), dict(sorted(known.items())),
                counter["compiles"], counter["seconds"])


def _refused_as_population(group: list) -> str | None:
  """Why the trainer refuses the group's runs as one population (`spec.population_run`: every config check
  of the population run, `config_checks.check_population` among them), else None; asked before anything
  is compiled or written."""
  try:
    spec.population_run(group, os.path.dirname(group[0].workdir))
  except SweepError as e:
    return f"refused as a population by the trainer's checks: {e}"
  return None


def _reason(k: int, limit: int, peaks: dict, budget: int, use: float, device: Device) -> str:
  """Why K: the budget, one run's peak, the per-member slope and the peak at K, and what stopped it
  (the group's size, or the smallest K known not to fit)."""
  slope_k = k if k > 1 else min(peaks, key=lambda j: (j == 1, j))
  per_member = (peaks[slope_k] - peaks[1]) / (slope_k - 1) if slope_k > 1 else 0
  over = sorted(j for j, p in peaks.items() if p > budget and j > k)
  room = _predict(peaks[1], k, peaks[k], budget, 10 ** 6) if k > 1 else 1
  why = f"all {limit} runs of the group fit (memory for about {room} by the line)" if k == limit else (
      f"K={over[0]} needs {gib(peaks[over[0]])}" if over else "the line through the measurements predicts no more")
  return (f"peak {gib(peaks[k])} per device at K={k} ≤ budget {gib(budget)} ({use:g} × {gib(device.capacity)}: "
          f"{device.source}); one run {gib(peaks[1])}, +{gib(per_member)} per member; {why}")


def choose_sizes(groups: list, device: Device | None, use: float, cache: Cache) -> list[Choice]:
  """Every group's Choice (all K = 1, with the reason, when there is no device to size for)."""
  if device is None:
    return [Choice(1, group_name(g), "no accelerator here and no --population_target (or "
                   "--population_device_gib): one program per run") for g in groups]
  choices = [choose_for_group(g, device, use, cache) for g in groups]
  cache.save({g[0].name: c.k for g, c in zip(groups, choices)})
  return choices


def plan_lines(choices: list[Choice], device: Device | None) -> list[str]:
  """The plan's lines: the device, then K and why for each run of consecutive groups with the same
  K and reason (with the compiles it took, or 'cached')."""
  if device is None:
    return [f"[sweep] population size auto → 1: {choices[0].reason}" if choices else ""]
  lines = [f"[sweep] population size auto on {device.name}:"]
  for (k, reason), same in itertools.groupby(choices, key=lambda c: (c.k, c.reason)):
    same = list(same)
    compiles, seconds = sum(c.compiles for c in same), sum(c.seconds for c in same)
    measured = "" if not same[0].peaks else (f" [{compiles} compile(s), {seconds:.0f} s]" if compiles else " [cached]")
    lines.append(f"[sweep]   K={k:<3} {', '.join(c.group for c in same)}: {reason}{measured}")
  return lines
