"""Several training steps per dispatch (`steps_per_dispatch`): the run's chunk plan, the choice of K,
what the host pays per call, and a loop the garbage collector leaves alone.

One call of the program (`training/program.py`) runs K steps, a scan over a stacked `[K, ...]`
chunk of batches (`training/chunk_loop.py`): the same K steps as K calls, bit for bit. What the host pays for a call (Python,
the few hundred arrays of the train state passed and donated, the CUDA graphs updated to the
state's new buffers) is paid once per K steps; what it pays per step inside the call (launching
the graphs and the library calls between them) is not (`host_seconds`). K is a property of the
dispatch, not of the run: a checkpoint resumes with any K.

The loop logs, evaluates and saves after the same steps whatever K (`sync_steps`): each chunk ends
on or before the next of them (`plan`). A gap between two such steps that K does not divide ends in
chunks of r = gcd(K, every gap) steps, the one shorter program a run compiles besides K's.

`auto` (the default) takes K = 1 off CUDA (a CPU is its own host; a TPU's long step hides its
launch) and on a CUDA GPU the smallest K, among the divisors of the run's usual gap, for which the
host's time per step (`host_seconds`, its per-call part shared by K steps) stays below the device's
(`device_seconds`, from the step's model FLOPs): one where the GPU is busy enough already.
"""
from __future__ import annotations

import contextlib
import gc
import math
from typing import Callable, Iterable

import ml_collections

from micse_jax.configs import population_fields
from micse_jax.evaluation.evaluators import is_due
from micse_jax.training.flops import step_flops_for

AUTO = "auto"
MAX_AUTO_STEPS = 16

# What the host pays for a call of the program, fitted to a lent H200's batch-50 step (its profile
# of the host and its dispatch time per step: BENCHMARKS.md, docs/AOT.md "The host"): the call itself
# (Python, jit's dispatch, PJRT's execute), each array passed in or out (parsed, donated, a new output
# `jax.Array`), each CUDA graph updated to the call's buffers (once per call: inside a call the loop's
# buffers stay where they are), each graph launch, each kernel or library call launched on its own,
# and each library call captured again into a graph whose buffers moved.
HOST_CALL_S = 300e-6
HOST_ARRAY_S = 2.6e-6
HOST_GRAPH_UPDATE_S = 100e-6
HOST_GRAPH_LAUNCH_S = 64e-6
HOST_LAUNCH_S = 17e-6
HOST_RECAPTURE_S = 80e-6
# How a step's launches scale with the encoder, before a compile counts them (auto's estimate): CUDA
# graphs and launches outside them (library calls and short runs of kernels) per encoder layer, as
# the calibrated batch-50 step has them (37 graphs, 162 launches for 12 layers).
GRAPHS_PER_LAYER = 3
LAUNCHES_PER_LAYER = 13.5
# The share of a GPU's dense peak a step's model FLOPs run at: batch 50 of BERT-base ran at 24 % on
# the H200, batch 512 at 36 % (`training/flops.py`'s count).
STEP_MFU = 0.25
# Dense bfloat16/float16 peaks by CUDA compute capability (datasheets: V100 float16, A100, A10/L4-class
# Ampere and Ada parts, H100/H200, B200).
PEAK_FLOPS = {(7, 0): 125e12, (8, 0): 312e12, (8, 6): 142e12, (8, 9): 330e12, (9, 0): 989e12, (10, 0): 2250e12}


def requested(value) -> int | None:
  """`steps_per_dispatch` as given (`config_checks` accepts "auto" or an integer >= 1, as text or
  int): None for auto, else K."""
  return None if str(value).strip() == AUTO else int(value)


def sync_steps(start: int, end: int, due: Callable[[int], bool]) -> list[int]:
  """The steps in (start, end] after which the loop logs, evaluates or saves (`due(done)`), and `end`."""
  return [done for done in range(start + 1, end + 1) if done == end or due(done)]


def gaps(start: int, syncs: Iterable[int]) -> list[int]:
  """The steps between consecutive sync steps, from `start`."""
  out, last = [], start
  for done in syncs:
    out.append(done - last)
    last = done
  return out


def remainder(steps: int, gap_sizes: Iterable[int]) -> int:
  """r: the length of the shorter chunks that fill what K leaves of each gap (gcd of K and the gaps)."""
  return math.gcd(steps, *gap_sizes)


def plan(start: int, syncs: list[int], steps: int) -> list[tuple[int, int]]:
  """The run's chunks (first step, length), in order: K-step chunks, each gap's rest in chunks of
  `remainder` steps, so that every sync step ends a chunk."""
  short, chunks, position = remainder(steps, gaps(start, syncs)), [], start
  for done in syncs:
    while position < done:
      length = steps if done - position >= steps else short
      chunks.append((position, length))
      position += length
  return chunks


def device_seconds(step_flops: float, compute_capability) -> float | None:
  """A CUDA GPU's predicted seconds per step from its model FLOPs (`STEP_MFU` of its dense peak);
  None for a GPU of no known peak."""
  peak = PEAK_FLOPS.get(tuple(compute_capability or ()))
  return step_flops / (peak * STEP_MFU) if peak else None


def host_seconds(arrays: int, graph_updates: int, graph_launches: int, launches: int, recaptures: int = 0) -> float:
  """The host's seconds for one call of a GPU program that passes `arrays` arrays, updates
  `graph_updates` CUDA graphs, launches graphs `graph_launches` times, `launches` kernels or library
  calls on their own, and captures `recaptures` library calls again (`aot/time_model.host_work`
  counts them in a compiled program)."""
  return (HOST_CALL_S + HOST_ARRAY_S * arrays + HOST_GRAPH_UPDATE_S * graph_updates
          + HOST_GRAPH_LAUNCH_S * graph_launches + HOST_LAUNCH_S * launches + HOST_RECAPTURE_S * recaptures)


def estimated_call_seconds(steps: int, arrays: int, layers: int) -> float:
  """`host_seconds` of a call of K = `steps` steps before it is compiled: its graphs and launches per
  step estimated from the encoder's `layers`, each graph updated once per call."""
  graphs = GRAPHS_PER_LAYER * layers + 1
  return host_seconds(arrays, graphs, steps * graphs, round(steps * LAUNCHES_PER_LAYER * layers))


def auto_steps(platform: str, compute_capability, step_flops: float, arrays: int, layers: int,
               usual_gap: int) -> int:
  """`auto`'s K (see the module docstring): 1 off CUDA or where no K helps; else the smallest divisor
  of `usual_gap` (at most `MAX_AUTO_STEPS`) whose host time per step is below the device's."""
  device = device_seconds(step_flops, compute_capability) if platform == "cuda" else None
  if device is None:
    return 1
  candidates = [k for k in range(1, min(usual_gap, MAX_AUTO_STEPS) + 1) if usual_gap % k == 0]
  for k in candidates:
    if estimated_call_seconds(k, arrays, layers) / k <= device:
      return k
  return candidates[-1]


def usual_gap(gap_sizes: list[int]) -> int:
  """The gcd of a run's gaps but its last (the last may end the run off the usual rhythm); 1 when none."""
  inner = gap_sizes[:-1] or gap_sizes
  return math.gcd(*inner) if inner else 1


def steps_for(config: ml_collections.ConfigDict, bert_config, target, arrays: int) -> int:
  """`steps_per_dispatch` for a program compiled for `target` (`kernels/choice.Target`): as given, or
  `auto`'s choice (`auto_steps`, from the step's model FLOPs on the model of `bert_config` and the
  `arrays` a call passes, over the run's usual gap between syncs)."""
  chosen = requested(config.get("steps_per_dispatch", 1))
  if chosen is not None:
    return chosen
  syncs = sync_steps(0, config.num_train_steps, lambda done: any(sync_due(config, True, done)))
  flops = max(population_fields.size(config), 1) * step_flops_for(config, bert_config)
  return auto_steps(target.platform, target.compute_capability, flops / max(target.devices, 1), arrays,
                    bert_config.num_hidden_layers, usual_gap(gaps(0, syncs)))


def sync_due(config: ml_collections.ConfigDict, evaluates: bool, done: int) -> tuple[bool, bool, bool]:
  """(log, evaluate, save) after `done` steps; the last step does all three that are enabled."""
  last = done == config.num_train_steps
  return (done % config.log_every == 0 or last, evaluates and is_due(done, config.eval_every, config.num_train_steps),
          done % config.checkpoint_every == 0 or last)


@contextlib.contextmanager
def quiet_collector():
  """The loop without Python's cyclic garbage collector: what set-up made is frozen out of its
  scans (`gc.freeze`) and automatic collections are off (every call makes new output arrays, which
  would set them off mid-dispatch); `collect()` runs one where the loop waits anyway."""
  gc.collect()
  gc.freeze()
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()
    gc.unfreeze()


def collect() -> None:
  """A collection of the young generations (what the loop made since the last), at a sync point."""
  gc.collect(1)
