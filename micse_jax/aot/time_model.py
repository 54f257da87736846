"""The step time of a compiled XLA program on a target device, predicted from its optimised HLO.

    python -m micse_jax.bench --aot h100 --model bert-base --batch_size 50 --dtype bfloat16
    python -m micse_jax.bench --aot_hlo step.hlo.txt.gz --aot h200

Each kernel (`aot/kernel_cost.py`: bytes it really reads and writes, GEMM FLOPs, inline threefry
rounds, sort and scatter work) takes

    t = LAUNCH_S [+ GEMM_OVERHEAD_S for a GEMM] + max(bytes / (bandwidth · e_mem),
          flops / (peak[dtype] · GEMM_EFFICIENCY), rounds / round_rate,
          sort traffic / (shared-memory bandwidth · SHARED_EFFICIENCY),
          updates / ATOMIC_RATE + updates per target element · ATOMIC_CHAIN_S)

with `e_mem` by what the kernel does (`memory_efficiency`: elementwise, reduction, narrow column
reduction, wide concatenate) and `round_rate` = the 32-bit integer lanes' rate / `OPS_PER_ROUND`
· `INTEGER_EFFICIENCY`. The kernels of one call add up to the device time (`predicted_device_ms`
per training step: a call of K steps, `steps_per_call`, runs its loop's kernels K times, `Cost.runs`):
XLA runs them one after another (CUDA graphs, kernels back to back; with `mesh.cuda_graphs` "kernels"
each cuBLAS / cuDNN call runs between two graphs, `GRAPH_BREAK_S` more).

The host's time per call (`aot/host.py`, priced by `training/dispatch.host_seconds`): the call and
the arrays it passes in and out, each CUDA graph updated to the call's buffers once and launched
once per step, every kernel of a run too short for a graph (`host.MIN_GRAPH_KERNELS`) and every library
call kept out of the graphs launched per step, and, with library calls inside the graphs ("xla"),
each captured again once per call when the host runs ahead. A program compiled without its GPU has
no library calls: the ones its autotuner would pick are estimated (`host.library_calls`). The trainer
does not wait for a call before dispatching the next, so a step takes the device time or, when the
host is slower, the host's (`predicted_step_ms` = max(device, host) per step); a call that is
waited for (`predicted_blocked_step_ms`, what a blocked benchmark measures) pays both.
`floor_ms`: each kernel's bytes at peak bandwidth or FLOPs at peak rate, the larger, summed, with no
launch cost. Constants and their sources: docs/AOT.md, "The time model". A TPU program is read the
same way (its fusions are its kernels; XLA:TPU runs the whole program as one, so the per-kernel and
host costs are small constants); TPU figures are not calibrated against a measurement.

A collective is priced on the target's links, not as a kernel (`aot/interconnect.py`: NCCL's
algorithms over NVLink and InfiniBand, a TPU slice's ICI; `predicted_collective_ms`, before any
overlap). The step's device time follows the scheduled program (`_timeline`): kernels run one
after another on the compute stream; an asynchronous collective starts where its `-start` is
scheduled (once the previous collective is done: one communication stream) and the compute
stream waits at its `-done` only for what the kernels scheduled between them did not cover; a
synchronous one is waited for at once. What the compute stream waits is the exposed collective
time (`predicted_exposed_collective_ms`), part of the device time; the rest is hidden.
"""
from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import sys

from micse_jax import jsonio
from micse_jax.aot import collectives, hlo, host, interconnect, kernel_cost
from micse_jax.aot.hlo_module import Module, parse
from micse_jax.errors import ConfigError

# One set of constants for every GPU target and point. The efficiencies and per-kernel costs are
# fitted once (least squares on log time, weighted by time) to the 1,868 kernels of the H200's
# batch-50 and batch-512 calibration traces (docs/AOT.md); the population trace
# (K = 5) was held out. Each lies where the trace's own kernel classes put it (comments).
MEMORY_EFFICIENCY = 0.75          # share of peak bandwidth: large elementwise fusions reach 3.2-3.7 TB/s of 4.8
REDUCTION_EFFICIENCY = 0.58       # fusions with a reduction: 2.5-3.0 TB/s
NARROW_COLUMNS_EFFICIENCY = 0.24  # column reductions into <= 16 K outputs (bias gradients): 1.1-1.4 TB/s
WIDE_CONCAT_EFFICIENCY = 0.29     # a concatenate of > WIDE_CONCAT operands (the flat update): 1.4-1.7 TB/s
WIDE_CONCAT = 16
GEMM_EFFICIENCY = 0.74            # share of the dense peak: bf16 GEMMs > 1 GFLOP, cuBLAS 807, Triton 680 TFLOP/s of 989
GEMM_OVERHEAD_S = 2.3e-6          # a GEMM's prologue and epilogue (the cuBLAS fit's intercept: 4.7 us with launch)
LAUNCH_S = 1.7e-6                 # a kernel in a CUDA graph: kernels moving < 100 kB take 1.1-1.5 us, 64 kB-1 MB 2 us
OPS_PER_ROUND = 3                 # a threefry round: a 3-input add, a funnel-shift rotate, an xor (IADD3, SHF, LOP3)
INTEGER_EFFICIENCY = 0.85         # the threefry fusions: 4.7-5.8 T rounds/s of 5.6 (132 SMs x 64 lanes x 1.98 GHz / 3)
SHARED_EFFICIENCY = 0.65          # the bitonic sorts: 0.64-0.66 of 128 B/clock/SM of shared memory
ATOMIC_RATE = 2.1e11              # scatter-add updates/s (the word-embedding gradient: 25 M updates in 120 us)
ATOMIC_CHAIN_S = 20e-9            # atomics on one address run one after another (the token-type gradient: 16 K deep)
PRE_AMPERE = ("v100",)            # GPU targets below compute capability 8.0 (`xla_options.cuda_graphs_for`)
GRAPH_BREAK_S = 2e-6              # a library call between two CUDA graphs: the GPU's gap (an estimate, not measured)
TPU_LAUNCH_S = 0.3e-6             # XLA:TPU runs the whole step as one program: a fusion boundary, not a launch
TPU_HOST_S = 100e-6               # one program launch per step


@dataclasses.dataclass(frozen=True)
class Device:
  """A target's peaks: memory bandwidth (bytes/s), dense FLOP/s per GEMM operand type, 32-bit
  integer operations/s (threefry), and whether it is a GPU (kernels, CUDA graph) or a TPU."""
  name: str
  bandwidth: float
  flops: dict
  integer_ops: float
  platform: str = "gpu"
  memory_bytes: float = 0.0
  shared_bandwidth: float = 0.0  # GPU: SMs × 128 B per clock of shared memory


def _gpu(name, bandwidth, bf16, tf32, f32, sms, clock_ghz, memory, f16=None, f8=None) -> Device:
  flops = {"bf16": bf16, "f16": f16 or bf16, "tf32": tf32, "f32": f32, "f64": f32, "f8e4m3fn": f8 or bf16,
           "f8e5m2": f8 or bf16, "s8": f8 or bf16}
  clock = clock_ghz * 1e9  # 64 INT32 lanes and 128 bytes of shared memory per clock per SM
  return Device(name, bandwidth, flops, sms * 64 * clock, "gpu", memory, sms * 128 * clock)


# NVIDIA datasheets (SXM parts, dense tensor-core rates) and architecture whitepapers (SMs, boost clock).
DEVICES = {
    "h100": _gpu("H100 SXM5 80GB", 3.35e12, 989.4e12, 494.7e12, 66.9e12, 132, 1.98, 80e9, f8=1978.9e12),
    "h200": _gpu("H200 SXM 141GB", 4.8e12, 989.4e12, 494.7e12, 66.9e12, 132, 1.98, 141e9, f8=1978.9e12),
    "a100": _gpu("A100 SXM4 80GB", 2.039e12, 312e12, 156e12, 19.5e12, 108, 1.41, 80e9),
    # Volta: float16 tensor cores (125 TFLOP/s); bfloat16 has none (runs at the float32 rate), no TF32.
    "v100": _gpu("V100 SXM2 32GB", 0.9e12, 15.7e12, 15.7e12, 15.7e12, 80, 1.53, 32e9, f16=125e12),
    # Google Cloud TPU system architecture pages: bf16 peak and HBM bandwidth per chip.
    "tpu-v4": Device("TPU v4", 1.2e12, {"bf16": 275e12, "f32": 275e12 / 6, "tf32": 275e12 / 3}, 0, "tpu", 32e9),
    "tpu-v5e": Device("TPU v5e", 0.819e12, {"bf16": 197e12, "f32": 197e12 / 6, "tf32": 197e12 / 3}, 0, "tpu", 16e9),
    "tpu-v5p": Device("TPU v5p", 2.765e12, {"bf16": 459e12, "f32": 459e12 / 6, "tf32": 459e12 / 3}, 0, "tpu", 95e9),
    "tpu-v6e": Device("TPU v6e", 1.64e12, {"bf16": 918e12, "f32": 918e12 / 6, "tf32": 918e12 / 3}, 0, "tpu", 32e9),
}


def round_rate(device: Device) -> float:
  """Threefry rounds per second the device computes (GPU: its INT32 lanes; a TPU: its VPU,
  taken as a tenth of its bf16 matrix rate in 32-bit operations: not calibrated)."""
  ops = device.integer_ops or device.flops["bf16"] / 10
  return ops / OPS_PER_ROUND * INTEGER_EFFICIENCY


def memory_efficiency(cost: kernel_cost.Cost) -> float:
  """The share of peak bandwidth a kernel's memory traffic gets (see the module docstring)."""
  if cost.concat_operands > WIDE_CONCAT:
    return WIDE_CONCAT_EFFICIENCY
  if cost.narrow_columns:
    return NARROW_COLUMNS_EFFICIENCY
  return REDUCTION_EFFICIENCY if cost.reduces else MEMORY_EFFICIENCY


def kernel_class(cost: kernel_cost.Cost) -> str:
  """The model's class of a kernel: which term and efficiency time it (for per-class errors)."""
  if cost.flops:
    return cost.kind if cost.kind.startswith("GEMM") else "GEMM (other)"
  if cost.rounds:
    return "threefry (inline RNG)"
  if cost.sort_traffic:
    return "sort"
  if cost.atomic_updates:
    return "scatter-add"
  if cost.concat_operands > WIDE_CONCAT:
    return "concatenate (wide)"
  if cost.narrow_columns:
    return "column reduction (narrow)"
  return "reduction" if cost.reduces else "elementwise / copy / transpose"


def kernel_seconds(cost: kernel_cost.Cost, device: Device) -> float:
  """One kernel's predicted time (see the module docstring)."""
  memory = cost.bytes / (device.bandwidth * memory_efficiency(cost))
  gemm = cost.flops / (device.flops.get(cost.dtype, device.flops["f32"]) * GEMM_EFFICIENCY) if cost.flops else 0.0
  rng = cost.rounds / round_rate(device) if cost.rounds else 0.0
  gpu = device.platform == "gpu"
  sort = cost.sort_traffic / (device.shared_bandwidth * SHARED_EFFICIENCY) if cost.sort_traffic and gpu else 0.0
  atomics = cost.atomic_updates / ATOMIC_RATE + cost.atomic_chain * ATOMIC_CHAIN_S if gpu else 0.0
  launch = LAUNCH_S if gpu else TPU_LAUNCH_S
  seconds = launch + max(memory, gemm, rng, sort, atomics) + (GEMM_OVERHEAD_S if cost.flops and gpu else 0.0)
  return seconds * cost.measured_factor


def floor_seconds(cost: kernel_cost.Cost, device: Device) -> float:
  """The kernel at the device's peaks alone: max(bytes / bandwidth, FLOPs / peak)."""
  gemm = cost.flops / device.flops.get(cost.dtype, device.flops["f32"]) if cost.flops else 0.0
  return max(cost.bytes / device.bandwidth, gemm)


def host_call_seconds(work: dict, device: Device) -> float:
  """The host's seconds for one call: `host.seconds` of its `host.work` on a GPU, a fixed launch on a
  TPU (XLA:TPU runs the whole program at once)."""
  return host.seconds(work) if device.platform == "gpu" else TPU_HOST_S


def _ms_by(timed, attr: str) -> dict:
  total = collections.Counter()
  for cost, seconds in timed:
    total[getattr(cost, attr)] += 1e3 * seconds
  return dict(total.most_common())


def _schedule(module: Module, kernel_names: set, waits_at: dict) -> list[tuple[str, str]]:
  """[("kernel", name) | ("done", its start's name)] in the scheduled order of the entry
  computation (`aot/hlo.scheduled`); `waits_at`: {kernel: collective it waits for first} (a
  collective without a `-done`)."""
  order = []
  for ins in hlo.scheduled(module):
    if ins.name in kernel_names:
      order.extend([("done", waits_at[ins.name])] if ins.name in waits_at else [])
      order.append(("kernel", ins.name))
    elif ins.opcode.endswith("-done") and ins.operands:
      order.append(("done", ins.operands[0]))
  return order


def _timeline(order, compute: dict, priced: dict, sync: set) -> dict:
  """{collective: seconds the compute stream waits for it}: kernels back to back on the compute
  stream, collectives one at a time on a communication stream from their `-start`, waited for at
  their `-done` (a synchronous one at once; one never waited for, at the step's end)."""
  now, link_free, ends, waited = 0.0, 0.0, {}, dict.fromkeys(priced, 0.0)

  def wait(name):
    nonlocal now
    end = ends.pop(name, now)
    waited[name] += max(0.0, end - now)
    now = max(now, end)

  for event, name in order:
    if event == "done":
      if name in priced:  # an async copy's `-done` is no collective
        wait(name)
    elif name in priced:
      link_free = ends[name] = max(now, link_free) + priced[name]
      if name in sync:
        wait(name)
    else:
      now += compute[name]
  for name in list(ends):
    wait(name)
  return waited


def _priced_collectives(module: Module, target: str) -> tuple[dict, dict]:
  """({kernel name: `collectives.Collective`}, {kernel name: (seconds, algorithm)}) on `target`'s links."""
  found = collectives.program_collectives(module)
  return found, {name: interconnect.seconds(c, target, module.num_devices) for name, c in found.items()}


def predict(module: Module, target: str, top: int = 20, members: int = 1, cuda_graphs: str | None = "kernels") -> dict:
  """The predicted step of an optimised HLO module (`hlo_module.parse`) on `target` (a key of `DEVICES`),
  JSON-able, per training step (a call of K steps, `steps_per_call`, divided by K): `predicted_step_ms` (pipelined,
  as the trainer runs: the slower of the device's time and the host's), `predicted_blocked_step_ms`
  (each call waited for: both), `predicted_device_ms`, `predicted_host_ms` (`aot/host.py`), `floor_ms`,
  by phase and kind, bytes, FLOPs and threefry hashes per step, the `top` largest kernels,
  collectives priced (`predicted_collective_ms`) and exposed (`predicted_exposed_collective_ms`);
  `members` > 1 (a population step) adds `predicted_ms_per_member_step`. `cuda_graphs`: what the
  program's CUDA graphs hold (`mesh.cuda_graphs`): "kernels", each library call costs the GPU a
  graph boundary (`GRAPH_BREAK_S`) and the host a launch; "xla", the host may capture them again."""
  device = DEVICES[target]
  costs = kernel_cost.costs(module)
  steps = hlo.steps_per_call(module)
  found, priced = _priced_collectives(module, target)
  gpu = device.platform == "gpu"
  runs = {c.name: c.runs for c in costs}
  boundary = GRAPH_BREAK_S if cuda_graphs == "kernels" else 0.0
  compute = {c.name: c.runs * (kernel_seconds(c, device) + (boundary if c.library and gpu else 0.0))
             for c in costs if c.name not in priced}
  order = _schedule(module, {c.name for c in costs}, {c.done: k for k, c in found.items() if c.done})
  waited = _timeline(order, compute, {k: s * runs.get(k, 1) for k, (s, _) in priced.items()},
                     {k for k, c in found.items() if c.sync})
  timed = [(c, (waited[c.name] if c.name in priced else compute[c.name]) / steps) for c in costs]
  device_s = sum(s for _, s in timed)
  work = host.work(costs, host.entry_arrays(module), cuda_graphs if gpu else None, host_ahead=False)
  if cuda_graphs == "xla" and host_call_seconds(work, device) / steps < device_s:  # the host runs ahead
    work = host.work(costs, work["arrays"], cuda_graphs, host_ahead=True)
  host_s = host_call_seconds(work, device) / steps
  step_s = max(device_s, host_s)
  largest = sorted(timed, key=lambda x: -x[1])[:top]
  floor_s = sum(c.runs * floor_seconds(c, device) for c in costs if c.name not in priced) / steps
  extra = {"predicted_ms_per_member_step": 1e3 * step_s / members} if members > 1 else {}
  per_step = lambda n: n / steps
  return {
      "time_model_target": target, "time_model_device": device.name, **extra,
      "predicted_step_ms": 1e3 * step_s, "predicted_over_floor": step_s / floor_s if floor_s else None,  # None: no kernel moves a byte
      "predicted_blocked_step_ms": 1e3 * (device_s + host_s),
      "predicted_device_ms": 1e3 * device_s, "predicted_host_ms": 1e3 * host_s, "steps_per_call": steps,
      "host_per_call": work, "cuda_graphs": cuda_graphs if gpu else None,
      "library_calls_per_step": per_step(sum(c.runs for c in costs if c.library and gpu)),
      "floor_ms": 1e3 * floor_s,
      "predicted_collective_ms": 1e3 * per_step(sum(s * runs.get(k, 1) for k, (s, _) in priced.items())),
      "predicted_exposed_collective_ms": 1e3 * per_step(sum(waited.values())),
      "interconnect": interconnect.links(target),
      "collectives_priced": [{"name": k, "kind": c.kind, "bytes": c.size, "devices": max(map(len, c.groups)),
                              "algorithm": priced[k][1], "ms": 1e3 * priced[k][0], "exposed_ms": 1e3 * waited[k]}
                             for k, c in found.items()],
      "predicted_ms_by_phase": _ms_by(timed, "phase"), "predicted_ms_by_kind": _ms_by(timed, "kind"),
      "bytes_per_step": per_step(sum(c.runs * c.bytes for c, _ in timed)),
      "flops_per_step": per_step(sum(c.runs * c.flops for c, _ in timed)),
      "rng_hashes_per_step": per_step(sum(c.runs * c.rounds for c, _ in timed)) / kernel_cost.ROUNDS_PER_HASH,
      "kernels_per_step": per_step(sum(c.runs for c, _ in timed)),
      "largest_kernels": [{"name": c.name, "kind": c.kind, "phase": c.phase, "ms": 1e3 * s, "bytes": c.bytes,
                           "flops": c.flops, "rng_hashes": c.rounds / kernel_cost.ROUNDS_PER_HASH}
                          for c, s in largest]}


def read_hlo(path: str) -> str:
  """A saved optimised-HLO text file, plain or gzip-compressed (`ConfigError` if it is not one)."""
  try:
    with open(path, "rb") as f:
      head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rt", encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError, EOFError) as e:
    raise ConfigError(f"--aot_hlo {path}: cannot read it ({e})") from e
  if "\nENTRY " not in text and not text.startswith("ENTRY "):
    raise ConfigError(f"--aot_hlo {path}: no HLO module in it (expected the text of compiled.as_text())")
  return text


def check_platform(hlo_text: str, path: str, target: str) -> None:
  """`ConfigError` when the module says it was compiled for another platform than `target`'s (`hlo.compiled_for`):
  another backend's kernels, fusions and library calls are not the ones the target would run."""
  compiled_for, platform = hlo.compiled_for(hlo_text), DEVICES[target].platform
  if compiled_for is not None and compiled_for != platform:
    raise ConfigError(f"--aot_hlo {path} was compiled for {compiled_for.upper()}, not for {target}'s platform "
                      f"({platform.upper()}): its kernels are not the ones {target} runs; save the optimized HLO of a "
                      f"program compiled for {target} (python -m micse_jax.bench --aot {target} compiles the step)")


def run_saved(path: str, target: str, output: str | None = None, members: int = 1,
              cuda_graphs: str = "auto") -> dict:
  """`python -m micse_jax.bench --aot_hlo FILE --aot TARGET [--population K] [--cuda_graphs M]`: the
  time model of a saved program (K members: a population's; compiled with `mesh.cuda_graphs` M),
  with its kernel counts (no compile); prints the report and the JSON line, returns the result."""
  from micse_jax import cli
  with cli.input_errors_as_one_line():
    if target not in DEVICES:
      raise ConfigError(f"--aot_hlo goes with --aot TARGET, the device whose time is predicted: {', '.join(DEVICES)}")
    text = read_hlo(path)
    check_platform(text, path, target)
  module = parse(text)
  counts = hlo.summary(module)
  from micse_jax.training import xla_options
  cuda_graphs = xla_options.cuda_graphs_for(cuda_graphs, target not in PRE_AMPERE)  # "auto": as the program chose
  result = {"aot_hlo": path, "aot_target": target, **predict(module, target, members=members, cuda_graphs=cuda_graphs),
            "kernels_per_step": counts["kernels_per_step"], "by_kind": counts["by_kind"],
            "update_kernels_per_step": counts["update_kernels_per_step"]}
  print(f"micse_jax.bench --aot_hlo {path} --aot {target}: {result['kernels_per_step']} kernels")
  print("\n".join(report_lines(result)))
  if output:
    jsonio.write_json(output, result)
  print(json.dumps(result))
  sys.stdout.flush()
  return result


def _ratio(x: float | None) -> str:
  return "n/a" if x is None else f"{x:.2f}"


def report_lines(p: dict) -> list[str]:
  """The prediction as report lines."""
  h = p["host_per_call"]
  lines = [f"  time model ({p['time_model_device']}; docs/AOT.md): step {p['predicted_step_ms']:.2f} ms "
           f"pipelined, {p['predicted_blocked_step_ms']:.2f} ms blocked (device {p['predicted_device_ms']:.2f} ms, "
           f"host {p['predicted_host_ms']:.2f} ms per step; {p['steps_per_call']} step(s) per call), floor "
           f"{p['floor_ms']:.2f} ms (predicted / floor {_ratio(p.get('predicted_over_floor'))})"
           + (f"; {p['predicted_ms_per_member_step']:.2f} ms per member-step"
              if "predicted_ms_per_member_step" in p else ""),
           f"    host per call: {h['arrays']} arrays, {h['graph_updates']} CUDA graphs updated, {h['graph_launches']} "
           f"graph launches, {h['launches']} launches outside graphs ({h['library_calls_launched']} library calls), "
           f"{h['recaptures']} library calls captured again (CUDA graphs: {p['cuda_graphs']})",
           f"    collectives {p['predicted_collective_ms']:.2f} ms priced, "
           f"{p['predicted_exposed_collective_ms']:.2f} ms exposed ({p['interconnect']})",
           f"    {p['bytes_per_step'] / 1e9:.2f} GB moved, {p['flops_per_step'] / 1e12:.2f} TFLOP, "
           f"{p['rng_hashes_per_step'] / 1e6:.0f} M threefry hashes, {p['kernels_per_step']} kernels per step",
           "    predicted ms by phase: " + ", ".join(f"{k} {v:.2f}" for k, v in p["predicted_ms_by_phase"].items()),
           "    predicted ms by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in p["predicted_ms_by_kind"].items()),
           "    largest kernels:"]
  lines += [f"      {k['ms']:8.3f} ms  {k['name']:<40} {k['kind']:<28} {k['phase']}" for k in p["largest_kernels"]]
  return lines
