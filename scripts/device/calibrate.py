"""A calibration point for the time model: the step's compiled program, its timings and a kernel profile.

    python scripts/device/calibrate.py OUT [--points 50,512] [--population 5] [--dry]

On a lent GPU (the kit's wheels on PYTHONPATH, see docs/GPU_ACCEPTANCE.md) this writes, per point
(BERT-base shapes, random weights, bfloat16, 32 tokens; the bench's miCSE step):

  OUT/b<B>.hlo.txt.gz      the optimized HLO of the program the GPU ran (autotuned)
  OUT/b<B>.trace.json.gz   a jax.profiler trace of a few pipelined steps (perfetto JSON)
and OUT/calibration.json: blocked (median of one-step blocks) and pipelined (one block per run
of steps) step times, device ceilings (a large copy's bandwidth, a bf16 GEMM's rate, the launch
cost of a chain of tiny kernels, threefry's hash rate), the device and software.
`--dry` runs the same on CPU at the tiny shape (a rehearsal).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def _timed(fn, repeats: int) -> float:
  """Median seconds of `fn()` (blocked), after one warm-up call."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def ceilings(dry: bool) -> dict:
  """The device's measured ceilings: copy bandwidth, bf16 GEMM rate, launch cost, threefry rate."""
  n = (1 << 16) if dry else (1 << 29)  # 1 GiB of bf16 read + 1 GiB written
  x = jnp.ones((n,), jnp.bfloat16) * 1.5
  scale = jax.jit(lambda v: v * 3)
  copy_s = _timed(lambda: scale(x), 10)
  m = 256 if dry else 8192
  a = jax.random.normal(jax.random.PRNGKey(0), (m, m), jnp.bfloat16)
  b = jax.random.normal(jax.random.PRNGKey(1), (m, m), jnp.bfloat16)
  gemm = jax.jit(lambda p, q: p @ q)
  gemm_s = _timed(lambda: gemm(a, b), 10)
  bert = {}
  for rows, k, n_out in ((1600, 768, 768), (1600, 768, 3072), (1600, 3072, 768), (16384, 768, 768),
                         (16384, 768, 3072), (16384, 3072, 768)):
    if dry:
      rows, k, n_out = rows // 64, k // 16, n_out // 16
    p = jax.random.normal(jax.random.PRNGKey(2), (rows, k), jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(3), (k, n_out), jnp.bfloat16)
    s = _timed(lambda: gemm(p, q), 20)
    bert[f"{rows}x{k}x{n_out}"] = {"s": s, "tflops": 2 * rows * k * n_out / s / 1e12}
  tiny = jnp.ones((256,), jnp.float32)

  def chain(v):
    for _ in range(100):  # 100 dependent tiny kernels (barriers keep XLA from fusing them)
      v = jax.lax.optimization_barrier(jnp.sin(v))
    return v
  chain_s = _timed(lambda: jax.jit(chain)(tiny), 10)
  words = (1 << 12) if dry else (1 << 27)
  key = jax.random.PRNGKey(4)
  bits = jax.jit(lambda k: jax.random.bits(k, (words,), jnp.uint32))
  bits_s = _timed(lambda: bits(key), 10)
  return {"copy_bytes": 4 * n, "copy_s": copy_s, "copy_tb_per_s": 4 * n / copy_s / 1e12,
          "gemm_square": m, "gemm_s": gemm_s, "gemm_tflops": 2 * m ** 3 / gemm_s / 1e12, "bert_gemms": bert,
          "chain_kernels": 100, "chain_s": chain_s, "launch_us": chain_s / 100 * 1e6,
          "threefry_words": words, "threefry_s": bits_s, "threefry_gwords_per_s": words / bits_s / 1e9}


def save_text(path: str, text: str) -> None:
  with gzip.open(path, "wt", encoding="utf-8") as f:
    f.write(text)


def profile(run_steps, steps: int, out_path: str) -> None:
  """A jax.profiler trace of `run_steps(steps)` (pipelined), its perfetto JSON copied to `out_path`."""
  directory = tempfile.mkdtemp(prefix="calib_trace_")
  with jax.profiler.trace(directory, create_perfetto_trace=True):
    run_steps(steps)
  found = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "perfetto_trace.json.gz")))
  if found:
    shutil.copy(found[-1], out_path)


def step_times(call, steps: int, rounds: int = 3) -> dict:
  """Blocked (each step waited for) and pipelined (one wait per `steps`) seconds per step."""
  blocked = []
  for _ in range(steps):
    t = time.perf_counter()
    jax.block_until_ready(call())
    blocked.append(time.perf_counter() - t)
  pipelined = []
  for _ in range(rounds):
    t = time.perf_counter()
    for _ in range(steps):
      out = call()
    jax.block_until_ready(out)
    pipelined.append((time.perf_counter() - t) / steps)
  return {"blocked_ms": 1e3 * statistics.median(blocked), "pipelined_ms": 1e3 * min(pipelined),
          "pipelined_rounds_ms": [1e3 * p for p in pipelined]}


def solo_point(model_dir: str, batch_size: int, dtype: str, out: str, steps: int) -> dict:
  """One solo step point (see the module docstring)."""
  from micse_jax.bench import hardware, jax_step
  import transformers
  vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
  step = jax_step.JaxStep(model_dir, jax_step.random_batch(batch_size, 32, vocab), dtype)
  compile_s, _ = step.compile()
  save_text(os.path.join(out, f"b{batch_size}.hlo.txt.gz"), step.compiled.as_text())
  for _ in range(3):
    step.run_step()

  def call():
    step.state, metrics = step.compiled(step.state, step.batch)
    return metrics
  timing = step_times(call, steps)

  def run_steps(n):
    for _ in range(n):
      metrics = call()
    jax.block_until_ready(metrics)
  profile(run_steps, 5, os.path.join(out, f"b{batch_size}.trace.json.gz"))
  seconds = timing["pipelined_ms"] / 1e3
  return {"batch_size": batch_size, "compile_s": compile_s, **timing, "profiled_steps": 5,
          "mfu_pipelined": hardware.mfu(step.model_flops, seconds, dtype),
          "mfu_blocked": hardware.mfu(step.model_flops, timing["blocked_ms"] / 1e3, dtype),
          "peak_device_bytes": hardware.peak_device_bytes()}


def population_point(model_dir: str, members: int, batch_size: int, dtype: str, out: str, steps: int) -> dict:
  """A population of `members` at `batch_size`: compiled program, timings, profile."""
  from micse_jax.bench import population as pop_bench
  from micse_jax.training import population, population_trainer
  work = tempfile.mkdtemp(prefix="calib_population_")
  corpus = pop_bench.synthetic_corpus(os.path.join(work, "corpus.txt"))
  config = pop_bench.population_config(model_dir, batch_size, 32, dtype, members, corpus, 10_000)
  fresh = population_trainer.fresh_population(config)
  batch = population.stacked_batch([r.batches for r in fresh.runs], fresh.layout, 0, fresh.mesh)
  t = time.perf_counter()
  compiled = fresh.step.lower(fresh.state, batch, {}).compile()
  compile_s = time.perf_counter() - t
  save_text(os.path.join(out, f"k{members}.hlo.txt.gz"), compiled.as_text())
  box = {"state": fresh.state}

  def call():
    box["state"], metrics = compiled(box["state"], batch, {})
    return metrics
  for _ in range(3):
    jax.block_until_ready(call())
  timing = step_times(call, steps)

  def run_steps(n):
    for _ in range(n):
      metrics = call()
    jax.block_until_ready(metrics)
  profile(run_steps, 3, os.path.join(out, f"k{members}.trace.json.gz"))
  return {"members": members, "batch_size": batch_size, "compile_s": compile_s, **timing, "profiled_steps": 3,
          "ms_per_member_step_pipelined": timing["pipelined_ms"] / members}


def software() -> dict:
  import flax
  info = {"python": sys.version.split()[0], "jax": jax.__version__, "flax": flax.__version__,
          "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform}
  try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,"
                                         "clocks.max.sm,power.draw,temperature.gpu", "--format=csv"],
                                        capture_output=True, text=True, timeout=20).stdout
  except (OSError, subprocess.SubprocessError):
    pass
  return info


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out")
  p.add_argument("--points", default="50,512")
  p.add_argument("--population", type=int, default=5, help="members of the population point (0: none)")
  p.add_argument("--dry", action="store_true")
  args = p.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  from micse_jax.bench import jax_step
  model = "tiny" if args.dry else "bert-base"
  dtype = "bfloat16"
  result = {"software": software(), "model": model, "dtype": dtype, "max_length": 32, "points": [],
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
  path = os.path.join(args.out, "calibration.json")

  def save():
    with open(path, "w") as f:
      json.dump(result, f, indent=1)
  result["ceilings"] = ceilings(args.dry)
  save()
  print(json.dumps(result["ceilings"]), flush=True)
  model_dir = jax_step.model_dir_for(model)
  for b in [int(v) for v in args.points.split(",") if v]:
    result["points"].append(solo_point(model_dir, 4 if args.dry else b, dtype, args.out, 20))
    save()
    print(json.dumps(result["points"][-1]), flush=True)
  if args.population:
    result["population"] = population_point(model_dir, args.population, 4 if args.dry else 50, dtype, args.out, 10)
    save()
    print(json.dumps(result["population"]), flush=True)
  print("calibration done", flush=True)


if __name__ == "__main__":
  main()
