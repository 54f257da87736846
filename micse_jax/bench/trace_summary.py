"""Where a profiled step's time goes: XLA op events of a `jax.profiler` trace, summed by kind.

`python -m micse_jax.bench --profile DIR` writes `perfetto_trace.json.gz` under
`DIR/plugins/profile/<run>/`; `summarize(DIR, steps)` adds up the duration of every executed
XLA op (thunk) event, leaving out the containers that hold other ops (`while`, `call`,
`conditional`, the thunk executor) so that nothing is counted twice, and reports milliseconds
per step by kind (`KINDS`, matched on the op's name in order) and the largest single ops.
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
_CONTAINERS = re.compile(r"^(while|call|conditional|ThunkExecutor.*|end: .*)$")


def trace_file(directory: str) -> str:
  """The newest perfetto trace under a `jax.profiler` output directory."""
  files = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "perfetto_trace.json.gz")))
  if not files:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}/plugins/profile")
  return files[-1]


def op_durations(path: str) -> collections.Counter:
  """Microseconds per op name (suffix `.N` removed) over the XLA worker threads of one trace."""
  with gzip.open(path, "rt", encoding="utf-8") as f:
    events = json.load(f)["traceEvents"]
  threads = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  total = collections.Counter()
  for e in events:
    if e.get("ph") != "X" or threads.get(e.get("tid"), "python").startswith("python"):
      continue
    name = re.sub(r"\.\d+$", "", e["name"])
    if not _CONTAINERS.match(name) and not name.startswith("$"):
      total[name] += e.get("dur", 0)
  return total


def kind_of(name: str) -> str:
  """The op kind (`KINDS`) an XLA op name belongs to, else "other"."""
  return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def summarize(directory: str, steps: int, top: int = 8) -> dict:
  """{'ms_per_step_by_kind': {kind: ms}, 'top_ops_ms_per_step': [(op, ms)], 'op_ms_per_step': total}."""
  durations = op_durations(trace_file(directory))
  by_kind = collections.Counter()
  for name, us in durations.items():
    by_kind[kind_of(name)] += us
  per_step = lambda us: us / 1e3 / steps
  return {"ms_per_step_by_kind": {k: per_step(v) for k, v in by_kind.most_common()},
          "top_ops_ms_per_step": [(n, per_step(v)) for n, v in durations.most_common(top)],
          "op_ms_per_step": per_step(sum(durations.values()))}


def report_lines(summary: dict) -> list[str]:
  """Human-readable lines of a profile summary: time per op kind, the largest ops."""
  total = summary["op_ms_per_step"]
  lines = [f"  profile: XLA op time per step {total:.1f} ms (ops on all worker threads, summed), by kind:"]
  lines += [f"    {kind:<22} {ms:9.1f} ms  {100 * ms / total:5.1f}%"
            for kind, ms in summary["ms_per_step_by_kind"].items()]
  lines.append("    largest ops: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in summary["top_ops_ms_per_step"]))
  return lines
