"""Where a profiled step's time goes: XLA op or GPU kernel events of a `jax.profiler` trace, by kind.

`python -m micse_jax.bench --profile DIR` writes `perfetto_trace.json.gz` under
`DIR/plugins/profile/<run>/`; `summarize(DIR, steps)` reports milliseconds per step by kind and
the largest single ops. Each plane of the profile is a trace "process" (`/host:CPU`,
`/device:GPU:0`, ...) and each of its lines a "thread":

- On a GPU it adds up the kernels and copies on the device's CUDA stream lines (`Stream #N...`),
  and nothing from the host (whose thunk and launch events describe the same work) nor from the
  device's derived lines (`XLA Ops`, `XLA Modules`, `Steps`, ...: spans over those kernels).
  Kernel names are classified by `GPU_KINDS`: cuBLAS / cuBLASLt / cuDNN / CUTLASS / Triton GEMM
  kernels (`sm90_xmma_gemm_...`, `nvjet_...`, `cutlass...`, `gemm_fusion_dot...`) are matrix
  multiplies, cuDNN's fused attention is attention, XLA's own emitted kernels
  (`loop_add_fusion_3`, `input_reduce_fusion_1`, ...) are fusions, NCCL kernels collectives.
- On XLA:CPU it adds up every executed XLA op (thunk) event of the worker threads, leaving out
  the containers that hold other ops (`while`, `call`, `conditional`, the thunk executor) so
  that nothing is counted twice, classified by `KINDS`.

Given `phases` ({HLO instruction name: phase}, `bench/hlo_kernels.phase_by_instruction` of the
compiled step), it also adds up time per phase of the step (`phase_durations`): from the GPU's
`XLA Ops` line, whose events carry the HLO instruction names (the stream lines carry cuBLAS's
or cuDNN's own kernel names), or from the XLA:CPU op events, which are named by instruction.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

KINDS = (  # (kind, pattern on the op name without its ".N" suffix); first match wins
    ("matrix multiply", r"^(ynn_fusion|xnn_fusion|onednn.*|dot|dot_general|.*dot.*_fusion|convolution.*)$"),
    ("custom call", r"^custom-call"),
    ("scatter / gather", r"scatter|gather"),
    ("copy / transpose", r"^(copy|.*copy.*_fusion|transpose.*)$"),
    ("reduce", r"reduce"),
    ("sort / top-k", r"sort|top-?k"),
    ("elementwise fusion", r"_fusion$|^wrapped_"),
)
# GPU kernel names (demangled C++ or XLA's fusion names with "_N" suffixes): first match wins.
GPU_KINDS = (
    ("collective (NCCL)", r"nccl"),
    ("attention (cuDNN fused)", r"sdpa|flash|fmha|cudnn_generated_fort"),
    ("matrix multiply", r"gemm|gemv|xmma|cutlass|cublas|nvjet|wgmma|hmma|tensorop|matmul|"
                        r"^(void )?(ampere|volta|turing|sm\d+)_|cudnn|triton_.*dot|dot_general|^dot"),
    ("copy / transpose", r"memcpy|memset|^copy|copy_fusion|transpose"),
    ("sort / top-k", r"sort|top_?k|cub::"),
    ("scatter / gather", r"scatter|gather|dynamic_update_slice|dynamic_slice"),
    ("reduce fusion", r"reduce|reduction|^input_|softmax|^triton_"),
    ("elementwise fusion", r"fusion|^loop_|^wrapped_|^convert|^broadcast|^concatenate|^iota"),
)
_CONTAINERS = re.compile(r"^(while|call|conditional|ThunkExecutor.*|end: .*)$")
_DEVICE = re.compile(r"^/device:(GPU|gpu)")
_STREAM = re.compile(r"^Stream")
_DERIVED = re.compile(r"^(XLA |Steps|Framework|TensorFlow|Source|Launch|Memory|Sparse|python)")


def trace_file(directory: str) -> str:
  """The newest perfetto_trace.json.gz under DIR/plugins/profile/."""
  files = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "perfetto_trace.json.gz")))
  if not files:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}/plugins/profile")
  return files[-1]


def _load(path: str) -> tuple[list[dict], dict, dict]:
  """The trace's events, {pid: process name}, {(pid, tid): thread name}."""
  with gzip.open(path, "rt", encoding="utf-8") as f:
    events = json.load(f)["traceEvents"]
  meta = lambda kind: [e for e in events if e.get("ph") == "M" and e.get("name") == kind]
  processes = {e["pid"]: e["args"]["name"] for e in meta("process_name")}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta("thread_name")}
  return events, processes, threads


def op_durations(path: str) -> tuple[str, collections.Counter]:
  """("gpu", microseconds per kernel name) when the trace has GPU stream lines, else ("cpu",
  microseconds per XLA op name over the host's XLA worker threads); `.N` / `_N` suffixes removed."""
  events, processes, threads = _load(path)
  device = {key: name for key, name in threads.items() if _DEVICE.match(processes.get(key[0], ""))}
  streams = ({key for key, name in device.items() if _STREAM.match(name)}
             or {key for key, name in device.items() if not _DERIVED.match(name)})
  total = collections.Counter()
  for e in events:
    if e.get("ph") != "X":
      continue
    key = (e.get("pid"), e.get("tid"))
    if streams:
      if key in streams:
        total[re.sub(r"[._]\d+$", "", e["name"])] += e.get("dur", 0)
      continue
    if not threads.get(key, "python").startswith("python"):
      name = re.sub(r"\.\d+$", "", e["name"])
      if not _CONTAINERS.match(name) and not name.startswith("$"):
        total[name] += e.get("dur", 0)
  return ("gpu" if streams else "cpu"), total


def phase_durations(path: str, phases: dict[str, str]) -> collections.Counter:
  """Microseconds per phase of the trace's XLA ops (see the module docstring); ops of no known
  instruction are `(unattributed)`, containers (`while`, `call`, ...) are left out."""
  events, processes, threads = _load(path)
  device = {key: name for key, name in threads.items() if _DEVICE.match(processes.get(key[0], ""))}
  xla_ops = {key for key, name in device.items() if name == "XLA Ops"}
  total = collections.Counter()
  for e in events:
    key = (e.get("pid"), e.get("tid"))
    if e.get("ph") != "X" or (key not in xla_ops if xla_ops else threads.get(key, "python").startswith("python")):
      continue
    name = e["name"]
    if name in phases:
      total[phases[name]] += e.get("dur", 0)
    elif not (_CONTAINERS.match(re.sub(r"\.\d+$", "", name)) or name.startswith("$")):
      total["(unattributed)"] += e.get("dur", 0)
  return total


def kind_of(name: str, platform: str = "cpu") -> str:
  """The kind of an op (XLA:CPU op name) or of a kernel (GPU kernel name)."""
  kinds = GPU_KINDS if platform == "gpu" else KINDS
  flags = re.IGNORECASE if platform == "gpu" else 0
  return next((kind for kind, pattern in kinds if re.search(pattern, name, flags)), "other")


def summarize(directory: str, steps: int, top: int = 8, phases: dict[str, str] | None = None) -> dict:
  """{'platform': 'gpu' | 'cpu', 'ms_per_step_by_kind': {kind: ms}, 'top_ops_ms_per_step':
  [(op or kernel, ms)], 'op_ms_per_step': total}, and 'ms_per_step_by_phase' when `phases` is given."""
  path = trace_file(directory)
  platform, durations = op_durations(path)
  by_kind = collections.Counter()
  for name, us in durations.items():
    by_kind[kind_of(name, platform)] += us
  per_step = lambda us: us / 1e3 / steps
  summary = {"platform": platform, "ms_per_step_by_kind": {k: per_step(v) for k, v in by_kind.most_common()},
             "top_ops_ms_per_step": [(n[:80], per_step(v)) for n, v in durations.most_common(top)],
             "op_ms_per_step": per_step(sum(durations.values()))}
  if phases is not None:
    summary["ms_per_step_by_phase"] = {p: per_step(v) for p, v in phase_durations(path, phases).most_common()}
  return summary


def report_lines(summary: dict) -> list[str]:
  """The summary as report lines: total, time by kind, the largest ops or kernels."""
  total = summary["op_ms_per_step"]
  what = ("GPU kernel time per step {:.1f} ms (kernels and copies on the device's streams, summed)"
          if summary.get("platform") == "gpu" else
          "XLA op time per step {:.1f} ms (ops on all worker threads, summed)")
  lines = [f"  profile: {what.format(total)}, by kind:"]
  lines += [f"    {kind:<24} {ms:9.1f} ms  {100 * ms / total:5.1f}%"
            for kind, ms in summary["ms_per_step_by_kind"].items()]
  lines.append("    largest: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in summary["top_ops_ms_per_step"]))
  return lines
