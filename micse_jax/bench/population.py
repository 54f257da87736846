"""Population training on this machine's devices: member-steps per second for K members, and the
paper's few-shot protocol projected in device-hours from those figures (what a population saves).

    python -m micse_jax.bench --population_members 1,5,25 --model bert-base --batch_size 50 --dtype bfloat16

For each K: the bench's miCSE config (`bench/jax_step.bench_config`: AMI on the last four
layers, momentum encoder and queue) with `population.seeds = (1, ..., K)`, set up as the trainer
sets a population up (`training/program.py`: states stacked, the step vmapped, members spread
over the devices when they divide K) on a synthetic corpus of random
words (the step's time does not depend on the words); the first call (compile) is timed, then
`--warmup` steps, then `--steps` timed steps. Reported: ms per population step, member-steps per
second, their gain over K = 1, and the device's peak memory.

Projection (`project_fewshot`): the 100 runs of `configs/sweeps/micse_paper.py:fewshot` grouped
into populations of K (`studies/spec.group_populations`, as `micse-sweep --population_size K`
groups them), priced by `studies/spec.estimated_gpu_hours` (what the sweep's dry run prints)
with the measured step times, plus one measured compile per program. Every run is priced at the
miCSE step (the heaviest of the sweep's four methods). Counted: training steps and compiles;
not counted: dev evaluations, the final STS suite, model loads and tokenising.
"""
from __future__ import annotations

import os
import tempfile
import time

import jax
import numpy as np

from micse_jax.bench import hardware
from micse_jax.bench.jax_step import bench_config
from micse_jax.models.loading import load_config
from micse_jax.studies import spec
from micse_jax.training import program, run_inputs

FEWSHOT_SWEEP = "sweeps/micse_paper:fewshot"
CORPUS_SENTENCES = 2_000
WORDS_PER_SENTENCE = 40  # more word pieces than --max_length: every row is full


def synthetic_corpus(path: str, sentences: int = CORPUS_SENTENCES, seed: int = 0) -> str:
  """A text file of random lowercase words, one sentence a line."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  words = ["".join(rng.choice(letters, size=rng.integers(3, 9))) for _ in range(500)]
  with open(path, "w", encoding="utf-8") as f:
    for _ in range(sentences):
      f.write(" ".join(rng.choice(words, size=WORDS_PER_SENTENCE)) + "\n")
  return path


def population_config(model_dir: str, batch_size: int, max_length: int, dtype: str, members: int,
                      corpus: str, total_steps: int):
  """The bench's miCSE config as a population of `members` seeds on `corpus`, no caches."""
  config = bench_config(model_dir, load_config(model_dir).num_hidden_layers, batch_size, max_length, dtype)
  config.population.seeds = tuple(range(1, members + 1))
  config.data.corpus = corpus
  config.num_train_steps = total_steps
  config.cache.compilation = config.cache.tokenized = False  # the first call is a real compile
  return config


def measure(config, steps: int, warmup: int) -> dict:
  """First call (compile), `warmup` steps, then `steps` timed steps of `config`'s population."""
  runs = run_inputs.prepare_runs(config)
  prog = program.of_runs(config, runs, steps=1)  # the trainer's program, one step per call
  members = len(runs)
  batches = [prog.place_batch([r.batches.batch(s) for r in runs]) for s in range(1 + warmup + steps)]
  pstate = prog.initial_state(runs)
  start = time.perf_counter()
  prog = program.compiled(prog, run_once=True)  # compiled as the trainer compiles it: part of the first call
  pstate, metrics, _ = prog.run(pstate, batches[0])
  jax.block_until_ready(metrics)
  first_call_s = time.perf_counter() - start
  for batch in batches[1:1 + warmup]:
    pstate, metrics, _ = prog.run(pstate, batch)
  jax.block_until_ready(pstate)
  start = time.perf_counter()
  for batch in batches[1 + warmup:]:
    pstate, metrics, _ = prog.run(pstate, batch)
  jax.block_until_ready(pstate)
  step_s = (time.perf_counter() - start) / steps
  return {"members": members, "first_call_s": first_call_s, "ms_per_population_step": 1e3 * step_s,
          "member_steps_per_s": members / step_s, "peak_device_bytes": hardware.peak_device_bytes()}


def project_fewshot(measured: list[dict], sweep_dir: str) -> list[dict]:
  """Device-hours of the `fewshot` protocol for each measured K (see the module docstring)."""
  runs = spec.expand(spec.load_config_file(FEWSHOT_SWEEP), sweep_dir)
  solo = next((m for m in measured if m["members"] == 1), None)
  rows = []
  for m in measured:
    k = m["members"]
    launched, _ = spec.group_populations(runs, k, sweep_dir)
    step_ms = solo["ms_per_population_step"] if solo else m["ms_per_population_step"] / k
    steps, step_hours = spec.estimated_gpu_hours(launched, step_ms, 1, {}, {k: m["ms_per_population_step"]})
    compile_hours = len(launched) * m["first_call_s"] / 3600
    rows.append({"members": k, "runs": len(runs), "programs": len(launched), "program_steps": steps,
                 "step_hours": step_hours, "compile_hours": compile_hours, "hours": step_hours + compile_hours})
  return rows


def run(model_dir: str, members: list[int], batch_size: int, max_length: int, dtype: str, steps: int,
        warmup: int) -> dict:
  """Measures every K of `members` (in that order) and projects the few-shot protocol."""
  work = tempfile.mkdtemp(prefix="micse_population_bench_")
  corpus = synthetic_corpus(os.path.join(work, "corpus.txt"))
  measured = []
  for k in members:
    config = population_config(model_dir, batch_size, max_length, dtype, k, corpus, 1 + warmup + steps)
    measured.append(measure(config, steps, warmup))
    solo = next((m for m in measured if m["members"] == 1), None)
    if solo:
      measured[-1]["gain_over_solo"] = measured[-1]["member_steps_per_s"] / solo["member_steps_per_s"]
  return {"population": measured, "fewshot_projection": project_fewshot(measured, os.path.join(work, "sweep")),
          "fewshot_counted": "training steps + one compile per program; no dev evaluations, final STS, "
                             "model loads or tokenising; every run priced at the miCSE step"}


def report_lines(result: dict) -> list[str]:
  """The human-readable table of `run`'s result."""
  lines = ["  K | first call s | ms / population step | member-steps/s | gain over K=1 | peak device GiB"]
  for m in result["population"]:
    peak = m.get("peak_device_bytes")
    gain = m.get("gain_over_solo")
    lines.append(f"  {m['members']:>2} | {m['first_call_s']:11.1f} | {m['ms_per_population_step']:20.2f} | "
                 f"{m['member_steps_per_s']:14.1f} | {'—' if gain is None else f'{gain:.2f}x':>13} | "
                 f"{'—' if peak is None else f'{peak / 2 ** 30:.2f}'}")
  lines.append(f"  fewshot protocol ({result['fewshot_counted']}):")
  for p in result["fewshot_projection"]:
    lines.append(f"    K={p['members']}: {p['runs']} runs in {p['programs']} programs, {p['program_steps']:,} "
                 f"program steps: {p['step_hours']:.2f} h of steps + {p['compile_hours']:.2f} h of compiles "
                 f"= {p['hours']:.2f} device-hours")
  return lines
