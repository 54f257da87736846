"""Predicted beside measured for a program that a GPU ran: the time model per kernel class against
the kernel durations of the program's profile, and the share of kernel time mapped to its phases.

    python -m micse_jax.bench.model_check --hlo b50.hlo.txt.gz --trace b50.trace.json.gz --steps 5 \\
        --target h200 [--pipelined_ms 9.69 --blocked_ms 13.53]

`compare(hlo_text, trace_path, steps, target, ...)` (what the GPU kit calls after a profiled run:
the program's `compiled.as_text()`, its perfetto trace, the profiled steps, the time model's
target) maps every kernel event of the trace to its HLO instruction (`trace_summary.kernel_durations`),
times every instruction with the model (`aot/time_model.kernel_seconds`) and adds both up per
class of the model (`time_model.kernel_class`), per step.
"""
from __future__ import annotations

import argparse
import collections
import json

from micse_jax.aot import hlo_module, kernel_cost, time_model
from micse_jax.bench import trace_summary


def compare(hlo_text: str, trace_path: str, steps: int, target: str, pipelined_ms: float | None = None,
            blocked_ms: float | None = None, cuda_graphs: str = "kernels") -> dict:
  """{'by_class': {class: {'predicted_ms', 'measured_ms', 'error'}}, 'predicted_device_ms',
  'measured_kernel_ms', 'attributed_share', 'predicted_step_ms', 'predicted_blocked_step_ms', and
  the measured step times with their errors when given}; milliseconds per step."""
  device = time_model.DEVICES[target]
  module = hlo_module.parse(hlo_text)
  costs = kernel_cost.costs(module)
  durations, unattributed = trace_summary.kernel_durations(trace_path, [c.name for c in costs])
  by_class = collections.defaultdict(lambda: [0.0, 0.0])
  for cost in costs:
    row = by_class[time_model.kernel_class(cost)]
    row[0] += 1e3 * time_model.kernel_seconds(cost, device)
    row[1] += durations.get(cost.name, 0.0) / 1e3 / steps
  measured = (sum(durations.values()) + unattributed) / 1e3 / steps
  predicted = time_model.predict(module, target, top=0, cuda_graphs=cuda_graphs)
  error = lambda p, m: p / m - 1 if m else None
  result = {"target": target, "steps": steps, "measured_kernel_ms": measured,
            "attributed_share": 1 - unattributed / 1e3 / steps / measured if measured else 0.0,
            "predicted_device_ms": predicted["predicted_device_ms"],
            "predicted_step_ms": predicted["predicted_step_ms"],
            "predicted_blocked_step_ms": predicted["predicted_blocked_step_ms"],
            "by_class": {k: {"predicted_ms": p, "measured_ms": m, "error": error(p, m)}
                         for k, (p, m) in sorted(by_class.items(), key=lambda x: -x[1][1])}}
  result["device_error"] = error(result["predicted_device_ms"], measured)
  if pipelined_ms:
    result.update(pipelined_ms=pipelined_ms, pipelined_error=error(result["predicted_step_ms"], pipelined_ms))
  if blocked_ms:
    result.update(blocked_ms=blocked_ms, blocked_error=error(result["predicted_blocked_step_ms"], blocked_ms))
  return result


def report_lines(r: dict) -> list[str]:
  """The comparison as report lines (milliseconds per step, errors in percent)."""
  pct = lambda e: "n/a" if e is None else f"{100 * e:+.1f}%"
  lines = [f"kernel time mapped to the program's instructions: {100 * r['attributed_share']:.2f}%",
           f"device: predicted {r['predicted_device_ms']:.2f} ms, measured kernels {r['measured_kernel_ms']:.2f} ms "
           f"({pct(r['device_error'])})"]
  for key, label in (("pipelined", "pipelined step"), ("blocked", "blocked step")):
    if f"{key}_ms" in r:
      predicted = r["predicted_step_ms" if key == "pipelined" else "predicted_blocked_step_ms"]
      lines.append(f"{label}: predicted {predicted:.2f} ms, measured {r[f'{key}_ms']:.2f} ms ({pct(r[f'{key}_error'])})")
  lines += [f"  {k:<32} predicted {v['predicted_ms']:8.2f} ms  measured {v['measured_ms']:8.2f} ms  {pct(v['error'])}"
            for k, v in r["by_class"].items()]
  return lines


def main(argv=None) -> dict:
  """Command line: prints the comparison, then its JSON line."""
  p = argparse.ArgumentParser(prog="python -m micse_jax.bench.model_check", description=__doc__.splitlines()[0])
  p.add_argument("--hlo", required=True, help="the optimized HLO the GPU ran (compiled.as_text(); .gz ok)")
  p.add_argument("--trace", required=True, help="its jax.profiler perfetto trace (perfetto_trace.json.gz)")
  p.add_argument("--steps", type=int, required=True, help="steps in the trace")
  p.add_argument("--target", default="h200", choices=sorted(time_model.DEVICES))
  p.add_argument("--pipelined_ms", type=float, help="the measured pipelined step")
  p.add_argument("--blocked_ms", type=float, help="the measured blocked step")
  p.add_argument("--cuda_graphs", default="kernels", choices=("kernels", "xla", "fixed", "none"),
                 help="the program's mesh.cuda_graphs")
  args = p.parse_args(argv)
  result = compare(time_model.read_hlo(args.hlo), args.trace, args.steps, args.target, args.pipelined_ms,
                   args.blocked_ms, args.cuda_graphs)
  print("\n".join(report_lines(result)))
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
