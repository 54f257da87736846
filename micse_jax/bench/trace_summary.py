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

Given `phases` ({HLO instruction name: phase} in program order, `aot/hlo.phase_by_instruction`
of the compiled step), it also adds up time per phase of the step (`phase_durations`). On XLA:CPU
the op events are named by instruction. On a GPU each stream event names the HLO instruction that
launched it in `args.hlo_op` (the kernel's own name is cuBLAS's, or a fusion's shared kernel:
XLA launches one kernel for identical fusions, named after one of them, `_N` for `.N`), and such
an event maps directly: so do the cuBLAS / cuDNN calls launched between CUDA graphs. When
`hlo_op` names a command buffer (a CUDA graph: the whole step, `command_buffer_1`, or with
`mesh.cuda_graphs=kernels` one graph between two library calls) the graph's events of one launch
(one `correlation_id`) are a stretch of the program's kernel-launching instructions in program
order: those after the nearest event before the launch that maps directly and before the nearest
one after it (a graph that opens a step wraps around the program's end; the stretch of a command
buffer is what all its launches share). `align` walks the events and that stretch together: an
event goes to the next instruction whose name stem it shares (`loop_add_fusion_4` ~
`loop_add_fusion.7`); a library kernel (`nvjet_...`, `cublasLt::splitKreduce...`: a stem no
instruction has) to the next instruction that launches no kernel of its own name (a custom call,
a copy), or to the one before it when that one is a custom call that already launched one; a
memset goes with the instruction of the next event. What matches nothing is `(unattributed)`;
`attributed_share` says how much.
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


def _stream_lines(processes: dict, threads: dict) -> set:
  """{(pid, tid)} of the GPU's kernel lines: its `Stream ...` lines, else every device line but the
  derived ones (`XLA Ops`, `Steps`, ...); empty for a CPU trace."""
  device = {key: name for key, name in threads.items() if _DEVICE.match(processes.get(key[0], ""))}
  return ({key for key, name in device.items() if _STREAM.match(name)}
          or {key for key, name in device.items() if not _DERIVED.match(name)})


def op_durations(path: str) -> tuple[str, collections.Counter]:
  """("gpu", microseconds per kernel name) when the trace has GPU stream lines, else ("cpu",
  microseconds per XLA op name over the host's XLA worker threads); `.N` / `_N` suffixes removed."""
  events, processes, threads = _load(path)
  streams = _stream_lines(processes, threads)
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


def _stem(name: str) -> str:
  """A kernel or instruction name without its numeric suffixes, `.` as `_` (`fusion.12` -> `fusion`)."""
  return re.sub(r"([._]\d+)+$", "", name).replace(".", "_").replace("-", "_")


_MEMSET = re.compile(r"^memset", re.IGNORECASE)


_XLA_NAME = re.compile(r"fusion|^(loop|input|wrapped|triton)_")  # XLA's own kernels: named after their instruction
_BAND = 96  # the most by which events and instructions drift apart in one launch (extra library kernels)


def _pair_score(event: str, kernel: str, own: set) -> float | None:
  """How well a kernel event's stem fits an instruction's stem (None: it cannot)."""
  if event == kernel:
    return 3.0
  if event in own or _XLA_NAME.search(event):
    return None  # an XLA kernel named after another instruction
  return 3.0 if kernel not in own else 1.0  # a library kernel: a custom call or copy, else (weakly) any


def align(events: list[str], kernels: list[str]) -> list[int | None]:
  """For the kernel names of one launch of a command buffer (in launch order), the index into
  `kernels` (the program's kernel-launching instructions, in program order) of the instruction
  each belongs to, or None: the best-scoring monotone alignment (a banded dynamic programme over
  the non-memset events; see the module docstring)."""
  kernel_stems = [_stem(k) for k in kernels]
  real = [e for e, name in enumerate(events) if not _MEMSET.match(name)]
  stems = [_stem(events[e]) for e in real]
  own = set(kernel_stems) & set(stems)  # instructions that launch kernels of their own name
  n, m = len(stems), len(kernels)
  best, back = {(0, 0): 0.0}, {}
  for a in range(n + 1):
    for b in range(max(0, a - _BAND), min(m, a + _BAND) + 1):
      score = best.get((a, b))
      if score is None:
        continue
      moves = [((a, b + 1), score - 0.5, None)] if b < m else []  # an instruction that launched nothing
      if a < n:
        if b < m and (fit := _pair_score(stems[a], kernel_stems[b], own)) is not None:
          moves.append(((a + 1, b + 1), score + fit, b))
        extra = b > 0 and stems[a] not in own and kernel_stems[b - 1] not in own and not _XLA_NAME.search(stems[a])
        moves.append(((a + 1, b), score + (1.0 if extra else -2.0), b - 1 if extra else None))
      for key, value, k in moves:
        if value > best.get(key, float("-inf")):
          best[key], back[key] = value, ((a, b), k)
  last = max(k[0] for k in best)  # n, unless the events outrun the band (then the rest stays unmapped)
  key = max((k for k in best if k[0] == last), key=lambda k: best[k] - 0.5 * (m - k[1]))
  found = [None] * len(events)
  while key in back:
    previous, k = back[key]
    if previous[0] < key[0]:
      found[real[previous[0]]] = k
    key = previous
  following = None
  for e in reversed(range(len(events))):  # a memset goes with the next event's instruction
    if _MEMSET.match(events[e]):
      found[e] = following
    elif found[e] is not None:
      following = found[e]
  return found


def _direct(event: dict, known: set, by_kernel_name: dict) -> str | None:
  """The instruction a stream event names itself (`args.hlo_op`; by kernel name in a trace
  without it), or None (a command buffer's kernel, or a stranger)."""
  args = event.get("args", {})
  if args.get("hlo_op") in known:
    return args["hlo_op"]
  if not args.get("hlo_op"):
    return by_kernel_name.get(event["name"])
  return None


def _window(placed: list[int | None], first: int, last: int, count: int) -> list[int]:
  """The program positions a launch spanning stream events `first`..`last` can hold: those after
  the nearest event before it that names its instruction and before the nearest one after it.
  Where that one lies earlier in the program (the launch opens the next step), the window wraps
  around the program's end."""
  before = next((placed[j] for j in range(first - 1, -1, -1) if placed[j] is not None), -1)
  after = next((placed[j] for j in range(last + 1, len(placed)) if placed[j] is not None), count)
  if after > before:
    return list(range(before + 1, after))
  return list(range(before + 1, count)) + list(range(after))


def _stream_events(path: str) -> list[list[dict]]:
  """The kernel and copy events of each of the device's stream lines, in time order."""
  events, processes, threads = _load(path)
  streams = _stream_lines(processes, threads)
  lines = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
      lines[(e.get("pid"), e.get("tid"))].append(e)
  return [sorted(line, key=lambda e: e.get("ts", 0)) for line in lines.values()]


def _launch_windows(line: list[dict], placed: list[int | None], count: int) -> dict[tuple, tuple[list[int], list[int]]]:
  """{launch (module, command buffer, correlation id): (its events' indices in `line`, the program
  positions it can hold)}. A command buffer runs the same commands at every launch, so its window
  is what the windows of all its launches share (a launch that opens a step wraps around the
  program's end; another launch of it does not)."""
  launches = collections.defaultdict(list)
  for j, e in enumerate(line):
    if placed[j] is None:
      args = e.get("args", {})
      launches[(args.get("hlo_module"), args.get("hlo_op"), args.get("correlation_id"))].append(j)
  windows = {key: _window(placed, members[0], members[-1], count) for key, members in launches.items()}
  by_buffer = collections.defaultdict(list)
  for key in launches:
    if key[1]:
      by_buffer[key[:2]].append(key)
  for keys in by_buffer.values():
    shared = set.intersection(*(set(windows[k]) for k in keys))
    if shared:
      windows.update({k: [w for w in windows[k] if w in shared] for k in keys})
  return {key: (members, windows[key]) for key, members in launches.items()}


def kernel_durations(path: str, kernels: list[str]) -> tuple[collections.Counter, float]:
  """({instruction: microseconds}, unattributed microseconds) of a GPU trace's stream events:
  an event naming its instruction (`args.hlo_op`, or by kernel name in a trace without it) maps
  directly; the events of one command-buffer launch are `align`ed with the instructions between
  the nearest directly mapped events on the same stream before and after it (`_window`,
  `_launch_windows`)."""
  known, total, unattributed = set(kernels), collections.Counter(), 0.0
  by_kernel_name = {k.replace(".", "_"): k for k in kernels}
  position = {k: i for i, k in enumerate(kernels)}
  for line in _stream_events(path):
    placed = []
    for e in line:
      name = _direct(e, known, by_kernel_name)
      placed.append(None if name is None else position[name])
      if name is not None:
        total[name] += e.get("dur", 0)
    for members, window in _launch_windows(line, placed, len(kernels)).values():
      for j, k in zip(members, _placed_launch([line[j]["name"] for j in members], window, kernels)):
        if k is None:
          unattributed += line[j].get("dur", 0)
        else:
          total[kernels[k]] += line[j].get("dur", 0)
  return total, unattributed


def _placed_launch(names: list[str], window: list[int], kernels: list[str]) -> list[int | None]:
  """Program positions of one launch's events: `align`ed within `window`, or with the whole program
  where that places more of them (a window drawn from events of another step's pattern)."""
  found = [None if k is None else window[k] for k in align(names, [kernels[w] for w in window])]
  if None in found and len(window) < len(kernels):
    whole = align(names, kernels)
    if whole.count(None) < found.count(None):
      return whole
  return found


def phase_durations(path: str, phases: dict[str, str]) -> collections.Counter:
  """Microseconds per phase of the trace's XLA ops or GPU kernels (see the module docstring); what
  maps to no known instruction is `(unattributed)`, containers (`while`, `call`, ...) are left out."""
  events, processes, threads = _load(path)
  total = collections.Counter()
  if _stream_lines(processes, threads):
    durations, unattributed = kernel_durations(path, list(phases))
    for name, us in durations.items():
      total[phases[name]] += us
    if unattributed:
      total["(unattributed)"] += unattributed
    return total
  for e in events:
    key = (e.get("pid"), e.get("tid"))
    if e.get("ph") != "X" or threads.get(key, "python").startswith("python") or _DEVICE.match(
        processes.get(e.get("pid"), "")):
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
    by_phase = phase_durations(path, phases)
    summary["ms_per_step_by_phase"] = {p: per_step(v) for p, v in by_phase.most_common()}
    summary["attributed_share"] = 1 - by_phase["(unattributed)"] / max(sum(by_phase.values()), 1e-9)
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
