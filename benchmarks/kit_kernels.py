"""What the GPU kit reports of our own kernels: whether `gpu_tests`' gate proved them ("passed",
"failed", "not proven (time-out)"), which points ran them, their measured gain (b50 against
b50_explicit, a row beyond the lease: only where it ran), and the GPU tests' outcomes and seconds
(the gate, the trial tests, the others)."""
from __future__ import annotations


def gate_verdict(row: dict | None) -> str:
  """The gate's verdict in `gpu_tests`' last row: its run's `verdict`, "failed" where the step
  failed without one (it crashed), "did not run" without a row."""
  if not row:
    return "did not run"
  verdict = (row.get("result") or {}).get("verdict")
  return verdict or ("passed" if row["ok"] else "failed")


def kernels_line(s: dict, last: dict) -> str:
  """What `gpu_tests` said of our dropout-attention kernels, which points ran them and which the
  explicit path (a point takes them only once the gate passed, or its compile fell back), and
  their measured gain at batch 50 (b50 against b50_explicit, the same machine, both with auto's
  steps per call), said only where b50 ran with the kernels and b50_explicit ran: it comes after the
  lease's steps, when a command has its time."""
  gate = gate_verdict(last.get("gpu_tests"))
  verdict = ("a CPU dry run" if s["dry"] else "`gpu_tests` passed" if gate == "passed"
             else f"**`gpu_tests` {gate}: the kit's points train on the explicit path**")
  ran = [p for p in s["points"] if p["ok"]]
  with_kernels = [p["name"] for p in ran if p.get("own_kernels") and p.get("dropout_kernel_calls")]
  without = [p["name"] for p in ran if p["name"] not in with_kernels]
  line = (f"dropout-attention kernels: {verdict}; points with the kernels: {', '.join(with_kernels) or 'none'}; "
          f"on the explicit path: {', '.join(without) or 'none'}")
  ab = {p["name"]: p for p in ran}
  if "b50" in with_kernels and "b50_explicit" in ab:
    with_k, plain = ab["b50"], ab["b50_explicit"]
    line += (f". Batch 50, the same machine: {with_k['pipelined_step_ms']:.2f} ms with the kernels, "
             f"{plain['pipelined_step_ms']:.2f} ms without: {plain['pipelined_step_ms'] / with_k['pipelined_step_ms']:.3f}x")
    gpu = lambda p: (p.get("profile") or {}).get("gpu_ms_per_step")
    if gpu(with_k) and gpu(plain):
      line += f" ({gpu(with_k):.2f} against {gpu(plain):.2f} ms of GPU op time per step)"
  return line


def _seconds(run: dict) -> str:
  """A run's tests by their seconds, longest first."""
  found = sorted((run.get("seconds") or {}).items(), key=lambda x: -x[1])
  return ", ".join(f"{name} {s:.1f} s" for name, s in found)


def gpu_tests_lines(tests: dict | None) -> list[str]:
  """kit.md's lines on `pytest -m gpu`: the gate's counts, verdict, failures, where a time-out cut it,
  each test's seconds; the trial tests' and the other files' outcomes."""
  if not tests:
    return []
  verdict = tests.get("verdict") or ("passed" if tests["passed"] else "failed")
  lines = [f"- the gate, `pytest -m \"gpu and not trial\"` ({', '.join(tests['files'])}): **{verdict}**; "
           f"{tests['tests']} run, {tests['failures']} failed, {tests['errors']} errors, {tests['skipped']} skipped, "
           f"exit {tests['returncode']}"]
  failed = [name for name, outcome in tests.get("outcomes", {}).items() if outcome in ("failed", "error")]
  if failed:
    lines.append(f"- failed: {', '.join(failed)}")
  if tests.get("timed_out"):
    lines.append(f"- cut at its time-out after: {', '.join(tests.get('outcomes', {})) or 'no test'}")
  if tests.get("seconds"):
    lines.append(f"- seconds per test: {_seconds(tests)}")
  if not tests["passed"]:
    lines += ["", "```", tests["tail"][-1500:], "```"]
  for key, what in (("trial", "trial GPU tests (kernel uses not taken yet; they decide nothing)"),
                    ("others", "the other files' GPU tests (they decide nothing)")):
    run = tests.get(key)
    if run:
      outcomes = ", ".join(f"{name} {outcome}" for name, outcome in run.get("outcomes", {}).items())
      lines.append(f"- {what}: {outcomes or 'none ran'}" + (" (cut at the time-out)" if run.get("timed_out") else "")
                   + (f"; seconds: {_seconds(run)}" if run.get("seconds") else ""))
      if not run["passed"]:
        lines += ["", "```", run["tail"][-1500:], "```"]
  return lines


def kernel_variant_lines(v: dict | None) -> list[str]:
  """Our kernels alone under each warp count (`kit_points.kernel_variants`)."""
  if not v:
    return []
  lines = ["", f"## The dropout-attention kernels alone ({v['rows']} rows x {v['length']} tokens, {v['heads']} heads "
               f"of {v['head_dim']}, {v['dtype']}; the step launches them with {v['step_options']})", "",
           "| kernel | num_warps | us per call | values |", "|---|---|---|---|"]
  for r in v["variants"]:
    values = "the step's, bit for bit" if r["bitwise_equal"] else f"differ by up to {r['max_abs_difference']:.3g}"
    lines.append(f"| {r['kernel']} | {r['num_warps']} | {r['us_per_call']:.1f} | {values} |")
  return lines
