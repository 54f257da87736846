"""The kit's measurements, all in the runner's one process (nothing compiles twice).

A JAX point (`jax_point`, `population_point`) compiles the bench's miCSE step once, saves the
optimized HLO of the program this device runs (autotuned), times it pipelined and blocked
(`micse_jax.bench.timing`, as `python -m micse_jax.bench` does), then profiles a few pipelined
steps of the same executable with `jax.profiler` and keeps the perfetto trace and its summary.
A PyTorch point (`torch_point`) times one peer on the same weights and batch. `ceilings`
measures what the time model needs of the device: a large copy's bandwidth, a bf16 GEMM's rate,
the cost of a chain of tiny dependent kernels, threefry's hash rate. `kernel_variants` times our
dropout-attention kernels alone under each of Triton's warp counts, against the values of the one
the step uses.

One adapter, marked below, stands between the kit and code being rewritten elsewhere: the
profile summary (`profile_summary`: phases and kinds from `micse_jax.bench.trace_summary`,
kernels with their HLO instructions). The population's set-up is the trainer's program
(`training/program.py`).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
import time

SOLO_TIMING = {"warmup": 3, "steps": 20, "rounds": 3, "profile_steps": 5}
POPULATION_TIMING = {"warmup": 3, "steps": 10, "rounds": 3, "profile_steps": 3}
DRY_TIMING = {"warmup": 1, "steps": 2, "rounds": 2, "profile_steps": 1}


def save_text(path: str, text: str) -> None:
  """`text` gzipped into `path`."""
  with gzip.open(path, "wt", encoding="utf-8") as f:
    f.write(text)


def _hlo():
  """The HLO reader (`micse_jax/aot/hlo.py`) and parser (`micse_jax/aot/hlo_module.py`)."""
  from micse_jax.aot import hlo, hlo_module
  return hlo, hlo_module


def _kernels_per_step(hlo_text: str) -> float:
  """Kernels per training step of a compiled program (`hlo.summary`)."""
  hlo, hlo_module = _hlo()
  return hlo.summary(hlo_module.parse(hlo_text))["kernels_per_step"]


def profile(dispatch, wait, steps: int, trace_out: str) -> str:
  """A jax.profiler trace of `steps` pipelined steps (one wait at the end); its perfetto JSON is
  copied to `trace_out`. Returns the trace's folder."""
  import jax
  directory = tempfile.mkdtemp(prefix="micse_kit_trace_")
  with jax.profiler.trace(directory, create_perfetto_trace=True):
    handle = None
    for _ in range(steps):
      handle = dispatch()
    wait(handle)
  found = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "perfetto_trace.json.gz")))
  if found:
    shutil.copy(found[-1], trace_out)
  return directory


# ---------------------------------------------------------------- ADAPTER: the profile's summary
# The phase / kernel attribution of a GPU trace is being rewritten in bench/trace_summary.py
# (events mapped through the command buffer's kernel order). Until then: kinds and phases from
# today's `trace_summary.summarize`, kernels by exact name from the device's stream lines, each
# with the HLO instructions that launch it, found by name (XLA names a kernel after one of the
# instructions sharing a `deduplicated_name`, '.' -> '_'; library kernels such as cuBLAS's keep
# their own names and get none).

def profile_summary(trace_dir: str, hlo_text: str, steps: int, top: int = 30) -> dict:
  """{"gpu_ms_per_step", "ms_per_step_by_kind", "ms_per_step_by_phase", "top_kernels": [...]}."""
  from micse_jax.bench import trace_summary
  hlo, hlo_module = _hlo()
  phases = hlo.phase_by_instruction(hlo_module.parse(hlo_text))
  s = trace_summary.summarize(trace_dir, steps, phases=phases)
  kernels = top_kernels(trace_summary.trace_file(trace_dir), hlo_text, phases, steps, top)
  return {"platform": s["platform"], "profiled_steps": steps, "gpu_ms_per_step": s["op_ms_per_step"],
          "ms_per_step_by_kind": s["ms_per_step_by_kind"], "ms_per_step_by_phase": s.get("ms_per_step_by_phase", {}),
          "attributed_share": s.get("attributed_share"), "top_kernels": kernels}


def instructions_by_kernel(hlo_text: str) -> dict[str, list[str]]:
  """{kernel name: the instructions that launch it}. A kernel is named after one instruction,
  '.' -> '_'; the instructions that share that one's `deduplicated_name` run the same kernel."""
  dedup = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*", hlo_text, re.MULTILINE):
    shared = re.search(r'deduplicated_name="([^"]+)"', m.group(0))
    dedup[m.group(1)] = shared.group(1) if shared else m.group(1)
  groups = collections.defaultdict(list)
  for name, shared in dedup.items():
    groups[shared].append(name)
  return {name.replace(".", "_"): groups[shared] for name, shared in dedup.items()}


_CONTAINER = re.compile(r"^(while|call|conditional|ThunkExecutor|end: |\$)")  # XLA:CPU events holding others


def _stream_durations(trace_path: str, launched_by: dict | None = None) -> tuple[collections.Counter, collections.Counter]:
  """(microseconds, events) per exact event name on the device's stream lines (the GPU's kernels
  and copies), or on XLA:CPU's worker threads when the trace has no device; `launched_by`, when
  given, collects {name: the `args.hlo_op` of its events} (a library kernel launched outside the
  CUDA graphs names its custom call there)."""
  with gzip.open(trace_path, "rt", encoding="utf-8") as f:
    events = json.load(f)["traceEvents"]
  meta = lambda kind: {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                       if e.get("ph") == "M" and e.get("name") == kind}
  processes = {pid: name for (pid, _), name in meta("process_name").items()}
  threads = meta("thread_name")
  device = {k for k, n in threads.items() if processes.get(k[0], "").startswith("/device") and n.startswith("Stream")}
  keep = device or {k for k, n in threads.items() if not n.startswith("python")}
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in keep and not _CONTAINER.match(e["name"]):
      total[e["name"]] += e.get("dur", 0)
      count[e["name"]] += 1
      if launched_by is not None and e.get("args", {}).get("hlo_op"):
        launched_by.setdefault(e["name"], set()).add(e["args"]["hlo_op"])
  return total, count


def _natural(name: str) -> tuple:
  """`custom-call.9` before `custom-call.10`."""
  return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def top_kernels(trace_path: str, hlo_text: str, phases: dict[str, str], steps: int, top: int = 30) -> list[dict]:
  """The `top` kernels by time: ms per step, launches per step, their HLO instructions and phases."""
  by_kernel, launched_by = instructions_by_kernel(hlo_text), {}
  durations, counts = _stream_durations(trace_path, launched_by)
  known = {i for group in by_kernel.values() for i in group}
  rows = []
  for name, us in durations.most_common(top):
    instructions = by_kernel.get(name.replace(".", "_"), [])  # XLA:CPU events carry the instruction's own name
    if not instructions:  # a library kernel: the custom calls its events name
      instructions = sorted(launched_by.get(name, set()) & known, key=_natural)
    rows.append({"kernel": name, "ms_per_step": us / 1e3 / steps, "launches_per_step": counts[name] / steps,
                 "instructions": instructions[:8], "instruction_count": len(instructions),
                 "phases": sorted({phases[i] for i in instructions if i in phases})})
  return rows


# ---------------------------------------------------------------- points

def set_fields(config, overrides: dict) -> None:
  """Sets the config's dotted fields (`{"mesh.cuda_graphs": "xla"}`); a field the config lacks is an error."""
  for dotted, value in overrides.items():
    *parents, field = dotted.split(".")
    node = config
    for parent in parents:
      node = getattr(node, parent)
    if field not in node:
      raise KeyError(f"a kit point sets {dotted!r}, which the trainer's config does not have")
    setattr(node, field, value)


def attention_facts(prog, text: str, overrides: dict) -> dict:
  """What the point's program ran: the config fields it set, the attention mode asked for, whether
  our kernels were allowed (False after a failed compile: `program.compiled`'s fallback) and the
  kernel launches in its HLO."""
  from micse_jax.kernels import dropout_attention as da
  return {"overrides": dict(overrides), "attention": overrides.get("model.attention", "fused"),
          "own_kernels": prog.target.pallas,
          "dropout_kernel_calls": len(re.findall(rf'"{da.KERNEL_NAME}(?:_backward)?_h\d+"', text))}


def jax_point(name: str, model_dir: str, batch_size: int, max_length: int, dtype: str, raw: str,
              timing_args: dict, overrides: dict | None = None) -> dict:
  """A solo point: compile, HLO, blocked and pipelined times, profile (see the module docstring);
  `overrides`: the trainer's config fields the point sets (`kit_plan.Point.overrides`, e.g.
  `model.attention=explicit`: without the dropout-attention kernels)."""
  import transformers

  from micse_jax.bench import hardware, jax_step, timing
  overrides = dict(overrides or {})
  vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
  step = jax_step.JaxStep(model_dir, jax_step.random_batch(batch_size, max_length, vocab), dtype,
                          lambda config: set_fields(config, overrides))
  compile_s, _ = step.compile()
  text = step.compiled.as_text()
  save_text(os.path.join(raw, f"{name}.hlo.txt.gz"), text)
  dispatch, wait = timing.jax_peer(step)
  t = timing.measure(dispatch, wait, timing_args["warmup"], timing_args["steps"], timing_args["rounds"],
                    steps_per_call=step.steps)
  calls = timing_args["profile_steps"]
  trace_dir = profile(dispatch, wait, calls, os.path.join(raw, f"{name}.trace.json.gz"))
  mfu = lambda ms: hardware.mfu(step.model_flops, ms / 1e3, dtype)
  return {"kind": "solo", "members": 1, "batch_size": batch_size, "max_length": max_length, "dtype": dtype,
          "cuda_graphs": step.program.cuda_graphs, "steps_per_dispatch": step.steps,
          **attention_facts(step.program, text, overrides), "timing": timing_args, "compile_s": compile_s, **t,
          "mfu": mfu(t["pipelined_step_ms"]), "mfu_blocked": mfu(t["blocked_step_ms"]),
          "peak_device_bytes": hardware.peak_device_bytes(), "kernels_per_step": _kernels_per_step(text),
          "profile": profile_summary(trace_dir, text, calls * step.steps)}


def population_point(name: str, model_dir: str, members: int, batch_size: int, max_length: int, dtype: str,
                     raw: str, timing_args: dict, overrides: dict | None = None) -> dict:
  """A population of `members` at `batch_size`, measured as `jax_point` measures a solo step; its
  set-up is the trainer's (`training/program.py`: states stacked, the step vmapped)."""
  from micse_jax.bench import hardware, timing
  from micse_jax.bench import population as pop_bench
  from micse_jax.configs import population_fields
  from micse_jax.training import program, run_inputs
  corpus = pop_bench.synthetic_corpus(os.path.join(tempfile.mkdtemp(prefix="micse_kit_population_"), "corpus.txt"))
  config = pop_bench.population_config(model_dir, batch_size, max_length, dtype, members, corpus, 10_000)
  overrides = dict(overrides or {})
  set_fields(config, overrides)
  runs = [run_inputs.prepare(c) for c in population_fields.member_configs(config)]
  prog = program.of_runs(config, runs)
  state = prog.initial_state(runs)
  batch = prog.place_chunk([[r.batches.batch(i) for r in runs] for i in range(prog.steps)])
  start = time.perf_counter()
  prog = program.compiled(prog)  # the trainer's compile: kernels, else the explicit path
  compiled, compile_s = prog.executable, time.perf_counter() - start
  text = compiled.as_text()
  save_text(os.path.join(raw, f"{name}.hlo.txt.gz"), text)
  box = {"state": state}

  def dispatch():
    box["state"], metrics, _ = prog.run(box["state"], batch)
    return metrics
  import jax
  t = timing.measure(dispatch, jax.block_until_ready, timing_args["warmup"], timing_args["steps"], timing_args["rounds"],
                     steps_per_call=prog.steps)
  calls = timing_args["profile_steps"]
  trace_dir = profile(dispatch, jax.block_until_ready, calls, os.path.join(raw, f"{name}.trace.json.gz"))
  return {"kind": "population", "members": members, "batch_size": batch_size, "max_length": max_length,
          "dtype": dtype, "cuda_graphs": prog.cuda_graphs, "steps_per_dispatch": prog.steps,
          **attention_facts(prog, text, overrides),
          "timing": timing_args, "compile_s": compile_s, **t,
          "ms_per_member_step_pipelined": t["pipelined_step_ms"] / members,
          "peak_device_bytes": hardware.peak_device_bytes(), "kernels_per_step": _kernels_per_step(text),
          "profile": profile_summary(trace_dir, text, calls * prog.steps)}


def torch_point(model_dir: str, batch_size: int, max_length: int, dtype: str, mode: str, timing_args: dict) -> dict:
  """One PyTorch peer (`eager` or `compiled`) on the JAX point's weights and batch, timed alike."""
  import transformers

  from micse_jax.bench import jax_step
  from micse_jax.bench.torch_step import torch_benchmark
  vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
  batch = jax_step.random_batch(batch_size, max_length, vocab)
  start = time.perf_counter()
  t = torch_benchmark(model_dir, batch, dtype, timing_args["warmup"], timing_args["steps"], timing_args["rounds"],
                      mode)
  return {"kind": "torch", "mode": mode, "batch_size": batch_size, "max_length": max_length, "dtype": dtype, **t,
          "seconds_with_compile": time.perf_counter() - start}


# ---------------------------------------------------------------- device ceilings

def _timed(fn, repeats: int) -> float:
  """Median seconds of `fn()` (each call waited for), after one warm-up call."""
  import jax
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def ceilings(dry: bool) -> dict:
  """Copy bandwidth (1 GiB of bf16 read, 1 GiB written), an 8192^3 bf16 GEMM's rate, the launch
  cost of 100 dependent tiny kernels, threefry's words per second (small sizes with `dry`)."""
  import jax
  import jax.numpy as jnp
  n, m, words = ((1 << 16), 256, (1 << 12)) if dry else ((1 << 29), 8192, (1 << 27))
  def chain(v):
    for _ in range(100):  # barriers keep XLA from fusing the kernels
      v = jax.lax.optimization_barrier(jnp.sin(v))
    return v
  scale, gemm, chained = jax.jit(lambda v: v * 3), jax.jit(jnp.matmul), jax.jit(chain)  # each compiled once
  bits = jax.jit(lambda k: jax.random.bits(k, (words,), jnp.uint32))
  x, a = jnp.ones((n,), jnp.bfloat16) * 1.5, jax.random.normal(jax.random.PRNGKey(0), (m, m), jnp.bfloat16)
  tiny, key = jnp.ones((256,), jnp.float32), jax.random.PRNGKey(4)
  copy_s, gemm_s = _timed(lambda: scale(x), 10), _timed(lambda: gemm(a, a), 10)
  chain_s, bits_s = _timed(lambda: chained(tiny), 10), _timed(lambda: bits(key), 10)
  return {"copy_bytes": 4 * n, "copy_tb_per_s": 4 * n / copy_s / 1e12, "gemm_square": m,
          "gemm_tflops": 2 * m ** 3 / gemm_s / 1e12, "chain_kernels": 100, "launch_us": chain_s / 100 * 1e6,
          "threefry_words": words, "threefry_gwords_per_s": words / bits_s / 1e9}


# ---------------------------------------------------------------- our kernels' launch options

KERNEL_WARPS = (4, 1, 2, 8)  # the step's choice first: the others' values are held against it
KERNEL_CALLS = 20


def _kernel_us(fn, args, calls: int) -> tuple[float, int]:
  """(device microseconds per call of `fn(*args)`'s dropout-attention kernel, its events) in a
  profile of `calls` back-to-back calls: the device's kernel time, not the host's dispatch. On a
  device with no kernel named so (CPU, the interpreter), the time of every event in the trace."""
  import jax

  from micse_jax.kernels import dropout_attention as da
  directory = tempfile.mkdtemp(prefix="micse_kit_kernels_")
  jax.block_until_ready(fn(*args))
  with jax.profiler.trace(directory, create_perfetto_trace=True):
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
  found = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "perfetto_trace.json.gz")))
  durations, counts = _stream_durations(found[-1]) if found else (collections.Counter(), collections.Counter())
  ours = [n for n in durations if da.KERNEL_NAME in n]
  names = ours or list(durations)
  shutil.rmtree(directory, ignore_errors=True)
  return sum(durations[n] for n in names) / calls, sum(counts[n] for n in names)


def kernel_variants(dry: bool) -> dict:
  """Both dropout-attention kernels (the forward that saves its keep mask, the backward) at the
  b50 step's shapes (100 rows: two views of 50, 32 tokens, BERT-base's 12 heads of 64, bfloat16),
  launched with each of `KERNEL_WARPS`: device microseconds per call, and whether the values are
  bit for bit those of the step's choice (the largest difference if not). Dry: the interpreter
  at tiny shapes."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from micse_jax.kernels import dropout_attention as da
  rows, length, heads, head_dim = (4, 16, 2, 8) if dry else (100, 32, 12, 64)
  width, rate, dtype = 3 * heads * head_dim, 0.1, jnp.bfloat16
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  projection = jax.random.normal(keys[0], (rows, length, width), dtype)
  biases = tuple(0.1 * jax.random.normal(k, (heads * head_dim,), dtype) for k in jax.random.split(keys[1], 3))
  key_mask = (jnp.arange(length)[None, :] < jnp.arange(rows)[:, None] % length + length // 2).astype(jnp.int32)
  words = jax.random.key_data(keys[2])
  cotangent = jax.random.normal(keys[3], (rows, length, heads * head_dim), dtype)
  rows_out, reference = [], {}
  for warps in KERNEL_WARPS:
    triton = dict(da.TRITON_OPTIONS, num_warps=warps)
    forward = jax.jit(lambda p, triton=triton: da._pallas(p, biases, key_mask, words, rate, heads, save_keep=True,
                                                          interpret=dry, triton=triton))
    context, keep = forward(projection)
    backward = jax.jit(lambda p, c, triton=triton: da._pallas_backward(p, biases, key_mask, keep, c, rate, heads,
                                                                       interpret=dry, triton=triton))
    for kernel, fn, args in (("forward", forward, (projection,)), ("backward", backward, (projection, cotangent))):
      values = [np.asarray(v, np.float32) for v in jax.tree.leaves(fn(*args))]
      first = reference.setdefault(kernel, values)
      us, events = _kernel_us(fn, args, KERNEL_CALLS)
      rows_out.append({"kernel": kernel, "num_warps": warps, "us_per_call": us, "events_per_call": events / KERNEL_CALLS,
                       "bitwise_equal": all(np.array_equal(a, b) for a, b in zip(values, first)),
                       "max_abs_difference": max(float(np.max(np.abs(a - b))) for a, b in zip(values, first))})
  return {"rows": rows, "length": length, "heads": heads, "head_dim": head_dim, "dtype": "bfloat16",
          "step_options": da.TRITON_OPTIONS, "variants": rows_out}
