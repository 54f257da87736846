"""The kit's reports: rows -> kit.md and the calibration point (summary.md + summary.json), and
installing a returned point under docs/calibration/.

    python -m benchmarks.kit_report install RETURNED_DIR... [--docs docs/calibration] [--commit C] [--raw_to DIR]

`write` (called by the runner after every step) rewrites OUT: kit.jsonl (every row), kit.md
(steps, caches, `pytest -m gpu`, failures), summary.json and summary.md (per point: compile
time, pipelined and blocked step times, MFU, peak memory, kernels, both PyTorch peers and their
ratios, GPU time by phase and by kind, the 30 largest kernels with their HLO instructions, the
device ceilings) and raw.tar.gz (each point's optimized HLO and perfetto trace). Five files,
none in a folder: within what the device tool returns (8 files, 16 MiB each).

`install` merges the folders of one or two commands (a step's last row wins), fills the
"predicted" column from the returned HLO where `micse_jax.aot.time_model` exists (`predict`, an
adapter), writes docs/calibration/<device>-<date>-<commit>/summary.{md,json}, optionally unpacks
the raw files elsewhere (`--raw_to`: they are megabytes, not for the repository), and prints
the rows for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time

from benchmarks import kit_host, kit_kernels, kit_plan, kit_train
from micse_jax import jsonio
from micse_jax.bench import timing

ROWS_FILE = "kit.jsonl"
POINT_NAMES = tuple(kit_plan.POINTS)  # the kit's JAX points, in order
FIELD_LABELS = {("mesh.cuda_graphs", "xla"): "cuBLAS in the CUDA graphs",
                ("mesh.cuda_graphs", "fixed"): "CUDA graphs never updated",
                ("mesh.cuda_graphs", "none"): "no CUDA graphs", ("steps_per_dispatch", "1"): "one step per call"}
# The host's A/B rows beside b50 (kit_plan.PLAN): what each changes of the host's work per step
TORCH_MODES = {"eager": "eager PyTorch (public code)", "compiled": "compiled PyTorch (torch.compile)"}
PREDICTED_KEYS = ("predicted_step_ms", "predicted_blocked_step_ms", "floor_ms", "predicted_ms_by_phase",
                  "predicted_ms_by_kind", "predicted_ms_per_member_step", "predicted_collective_ms",
                  "predicted_exposed_collective_ms")


def read_rows(paths: list[str]) -> list[dict]:
  """The rows of every existing JSON-lines file among `paths`, in order (a last line cut short by
  a killed process is left out)."""
  rows = []
  for path in paths:
    if os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        for line in f:
          try:
            rows.append(json.loads(line))
          except json.JSONDecodeError:
            continue
  return rows


def setup_facts() -> dict:
  """Device, software, date and commit of this process (the commit from MICSE_KIT_COMMIT or git)."""
  import jax
  info = {"date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0], "jax": jax.__version__,
          "device_kind": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
          "commit": os.environ.get("MICSE_KIT_COMMIT") or _git_commit()}
  for package in ("flax", "torch", "transformers"):
    spec = importlib.util.find_spec(package)
    info[package] = __import__(package).__version__ if spec else None
  try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,"
                                         "clocks.max.sm,power.draw,temperature.gpu", "--format=csv"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    info["nvidia_smi"] = None
  return info


def _git_commit() -> str | None:
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    return out.stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def label(p: dict) -> str:
  """A point's name in the tables: dtype, batch, members (its step name where it failed early)."""
  if "batch_size" not in p:
    return p["name"]
  dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(p["dtype"], p["dtype"])
  path = "" if p.get("own_kernels", True) and p.get("dropout_kernel_calls", 1) else ", explicit attention"
  fields = p.get("overrides")
  if fields is None:  # a row of a kit whose points did not name their fields
    fields = {"mesh.cuda_graphs": "xla"} if p.get("cuda_graphs") == "xla" else {}
  path += "".join(", " + FIELD_LABELS.get((k, v), f"{k}={v}") for k, v in fields.items() if k != "model.attention")
  return (f"{dtype} population K={p['members']}, batch {p['batch_size']}{path}" if p["kind"] == "population"
          else f"{dtype} batch {p['batch_size']}{path}")


def timing_text(points: list[dict]) -> str:
  """How the points were timed (`micse_jax.bench.timing.PIPELINED` with their steps and rounds)."""
  args = {p["kind"]: p["timing"] for p in points if p.get("timing")}
  if not args:
    return ""
  first = args.get("solo") or args["population"]
  steps = str(first["steps"]) + (f" ({args['population']['steps']} for the population)"
                                 if "population" in args and args["population"]["steps"] != first["steps"] else "")
  return timing.PIPELINED.format(steps=steps, rounds=first["rounds"])


def latest(rows: list[dict]) -> dict[str, dict]:
  """{step: its last finished row} (the setup row: the last one)."""
  return {r["step"]: r for r in rows if "ok" in r}


def summary(rows: list[dict]) -> dict:
  """The calibration point: device, software, ceilings, and each JAX point with its peers."""
  last = latest(rows)
  setup = (last.get("setup") or {}).get("setup", {})
  points = []
  for name in POINT_NAMES:
    if name not in last:
      continue
    r = last[name]
    point = {"name": name, "ok": r["ok"], **(r.get("result") or {}), "error": r.get("error")}
    for mode in TORCH_MODES:
      peer = last.get(f"{name}_torch_{mode}")
      if peer and peer["ok"] and r["ok"]:
        t = peer["result"]
        point[f"torch_{mode}"] = {k: t.get(k) for k in ("pipelined_step_ms", "blocked_step_ms", "pipelined_rounds_ms",
                                                       "peak_device_bytes", "seconds_with_compile")}
        point[f"ratio_torch_{mode}"] = t["pipelined_step_ms"] / point["pipelined_step_ms"]
        point[f"ratio_torch_{mode}_blocked"] = t["blocked_step_ms"] / point["blocked_step_ms"]
    points.append(point)
  ceilings, variants = last.get("ceilings"), last.get("kernel_variants")
  s = {"device": setup.get("device_kind"), "date": setup.get("date"), "commit": setup.get("commit"),
       "dry": any(r.get("dry") for r in rows), "software": setup, "timing": timing_text(points),
       "ceilings": ceilings["result"] if ceilings and ceilings["ok"] else None, "points": points,
       "kernel_variants": variants["result"] if variants and variants["ok"] else None}
  s["gate"] = kit_kernels.gate_verdict(last.get("gpu_tests"))
  s["train"] = kit_train.train_summary(last.get("train"), next((p for p in points if p["name"] == "b50"), None))
  return dict(s, kernels=kit_kernels.kernels_line(s, last), host=kit_host.host_line(s))


def _f(x, fmt: str) -> str:
  return "—" if x is None else format(x, fmt)


def _pct(x) -> str:
  return "—" if x is None else f"{100 * x:.1f}%"


def _gib(b) -> str:
  return "—" if b is None else f"{b / 2 ** 30:.2f}"


def points_table(s: dict) -> list[str]:
  """Measured beside predicted, one row per point."""
  lines = ["| point | steps per call | CUDA graphs | compile s | pipelined ms | blocked ms | MFU (pipelined) "
           "| peak GiB | kernels/step | predicted ms | floor ms | measured / predicted |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for p in s["points"]:
    if not p["ok"]:
      lines.append(f"| {label(p)} | FAILED: {p['error']} |||||||||||")
      continue
    pred = p.get("predicted") or {}
    ratio = p["pipelined_step_ms"] / pred["predicted_step_ms"] if pred.get("predicted_step_ms") else None
    per_member = f" ({p['ms_per_member_step_pipelined']:.2f} per member)" if p["kind"] == "population" else ""
    lines.append(f"| {label(p)} | {_f(p.get('steps_per_dispatch'), '')} | {p.get('cuda_graphs') or '—'} "
                 f"| {p['compile_s']:.1f} | {p['pipelined_step_ms']:.2f}{per_member} "
                 f"| {p['blocked_step_ms']:.2f} | {_pct(p.get('mfu'))} "
                 f"| {_gib(p.get('peak_device_bytes'))} | {p.get('kernels_per_step')} "
                 f"| {_f(pred.get('predicted_step_ms'), '.2f')} | {_f(pred.get('floor_ms'), '.2f')} | {_f(ratio, '.2f')} |")
  return lines


def peers_table(s: dict) -> list[str]:
  """Both PyTorch peers beside micse_jax, pipelined (blocked in brackets)."""
  lines = ["| point | micse_jax ms | " + " | ".join(f"{label} ms | ratio" for label in TORCH_MODES.values()) + " |",
           "|---|---|" + "---|---|" * len(TORCH_MODES)]
  for p in (p for p in s["points"] if p["ok"] and p["kind"] == "solo"):
    cells = [label(p), f"{p['pipelined_step_ms']:.2f} ({p['blocked_step_ms']:.2f})"]
    for mode in TORCH_MODES:
      t = p.get(f"torch_{mode}")
      cells += ([f"{t['pipelined_step_ms']:.2f} ({t['blocked_step_ms']:.2f})",
                 f"{p[f'ratio_torch_{mode}']:.2f}x ({p[f'ratio_torch_{mode}_blocked']:.2f}x)"] if t else ["—", "—"])
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def profile_lines(p: dict) -> list[str]:
  """One point's GPU time by phase and kind (with predictions where known) and its largest kernels."""
  prof, pred = p["profile"], p.get("predicted") or {}
  total = prof["gpu_ms_per_step"] or 1.0
  host = (f"; the host dispatched a pipelined step in {p['dispatch_step_ms']:.2f} ms"
          if p.get("dispatch_step_ms") is not None else "")
  unattributed = ("" if prof.get("attributed_share") is None
                  else f", {100 * (1 - prof['attributed_share']):.2f}% of it in no phase")
  lines = [f"### {label(p)}: {prof['gpu_ms_per_step']:.2f} ms of {prof['platform'].upper()} op time "
           f"per step (profile of {prof['profiled_steps']} pipelined steps{unattributed}){host}", ""]
  for what, measured, predicted in (("phase", prof["ms_per_step_by_phase"], pred.get("predicted_ms_by_phase") or {}),
                                    ("kind", prof["ms_per_step_by_kind"], pred.get("predicted_ms_by_kind") or {})):
    lines += [f"| {what} | ms/step | % | predicted ms |", "|---|---|---|---|"]
    lines += [f"| {k} | {v:.3f} | {100 * v / total:.1f} | {_f(predicted.get(k), '.3f')} |" for k, v in measured.items()]
    lines.append("")
  if pred.get("model_check"):
    from micse_jax.bench import model_check
    lines += ["Time model against this profile (`python -m micse_jax.bench.model_check`):", "", "```",
              *model_check.report_lines(pred["model_check"]), "```", ""]
  lines += [f"{len(prof['top_kernels'])} largest kernels:", "", "| kernel | ms/step | launches/step | HLO instructions "
            "| phases |", "|---|---|---|---|---|"]
  for k in prof["top_kernels"]:
    more = k["instruction_count"] - len(k["instructions"])
    names = ", ".join(k["instructions"]) + (f" (+{more})" if more > 0 else "") or "(library kernel)"
    lines.append(f"| `{k['kernel'][:70]}` | {k['ms_per_step']:.3f} | {k['launches_per_step']:g} | {names} "
                 f"| {', '.join(k['phases'])} |")
  return lines + [""]


def summary_markdown(s: dict) -> str:
  """summary.md: the calibration point as it is committed under docs/calibration/."""
  sw = s["software"]
  lines = [f"# Calibration point: {s['device']}, {s['date']}, commit {s['commit']}"
           + (" (CPU dry run: tiny shapes, not figures)" if s["dry"] else ""), "",
           f"Software: Python {sw.get('python')}, jax {sw.get('jax')}, flax {sw.get('flax')}, torch {sw.get('torch')}, "
           f"transformers {sw.get('transformers')}. Model: BERT-base shapes with random weights (tiny in a dry run), "
           "the bench's miCSE step (benchmarks/kit.py, `micse_jax/bench/jax_step.py`). Step times: "
           f"{s['timing']}.", "", s.get("kernels", ""), ""] + ([s["host"], ""] if s.get("host") else [])
  if sw.get("nvidia_smi"):
    lines += ["    " + line for line in sw["nvidia_smi"].splitlines()] + [""]
  lines += points_table(s) + ["", "## The PyTorch peers (pipelined ms; blocked in brackets)", ""] + peers_table(s)
  c = s.get("ceilings")
  if c:
    lines += ["", f"Device ceilings: copy {c['copy_tb_per_s']:.2f} TB/s (bytes read + written), bf16 "
                  f"{c['gemm_square']}^3 GEMM {c['gemm_tflops']:.0f} TFLOP/s, {c['chain_kernels']} dependent tiny "
                  f"kernels {c['launch_us']:.2f} us each, threefry {c['threefry_gwords_per_s']:.0f} G words/s."]
  lines += kit_kernels.kernel_variant_lines(s.get("kernel_variants"))
  lines += kit_train.train_lines(s.get("train"))
  lines += ["", "## GPU time by phase, by kind, and the largest kernels", ""]
  for p in (p for p in s["points"] if p["ok"]):
    lines += profile_lines(p)
  return "\n".join(lines) + "\n"


def kit_markdown(rows: list[dict], steps) -> str:
  """kit.md: each of `steps`' ((name, planned s), ...) state and time, the caches, `pytest -m gpu`,
  failures; then the calibration point."""
  last, s = latest(rows), summary(rows)
  lines = ["# micse_jax GPU kit" + (" (CPU dry run)" if s["dry"] else ""), "", s["kernels"], "",
           status_line(rows, steps), "", "| step | state | seconds |", "|---|---|---|"]
  for name, planned in steps:
    r = last.get(name)
    state = "not run yet" if r is None else "ok" if r["ok"] else f"FAILED: {r.get('error') or 'see below'}"
    lines.append(f"| {name} | {state} | {_f(r and r.get('seconds'), '.0f')} (planned {planned}) |")
  caches = (last.get("caches") or {}).get("result")
  if caches:
    listing = "; ".join(f"{d} {v['bytes'] / 2 ** 20:.0f} MiB ({', '.join(v['entries'][:12]) or 'empty'})"
                        for d, v in caches["caches"].items())
    failed = caches["import_failures"]
    lines += ["", f"- model caches on the image: {listing or 'none'}",
              f"- the kit's packages import: {'ok' if not failed else 'FAILED: ' + json.dumps(failed)}"]
  lines += kit_kernels.gpu_tests_lines((last.get("gpu_tests") or {}).get("result"))
  for r in (r for r in last.values() if not r["ok"] and r.get("tail")):
    lines += ["", f"## {r['step']} failed", "", "```", r["tail"][-1500:], "```"]
  return "\n".join(lines) + "\n\n" + summary_markdown(s)


def status_line(rows: list[dict], steps) -> str:
  """One line: steps done, ok, failed, and those not run yet."""
  last = latest(rows)
  done = [n for n, _ in steps if n in last]
  failed = [n for n in done if not last[n]["ok"]]
  todo = [n for n, _ in steps if n not in last]
  return (f"kit: {len(done)} of {len(steps)} steps done, {len(done) - len(failed)} ok"
          + (f", failed: {', '.join(failed)}" if failed else "") + (f"; not run yet: {', '.join(todo)}" if todo else ""))


def _write_text(path: str, text: str) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def write(out: str, rows: list[dict], steps, raw: str | None = None) -> None:
  """Rewrites OUT's five files from `rows` of the runner's `steps` (and `raw`'s HLO and traces,
  see the module docstring)."""
  with open(os.path.join(out, f"{ROWS_FILE}.tmp"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  os.replace(os.path.join(out, f"{ROWS_FILE}.tmp"), os.path.join(out, ROWS_FILE))
  s = summary(rows)
  jsonio.write_json(os.path.join(out, "summary.json"), s)
  _write_text(os.path.join(out, "summary.md"), summary_markdown(s))
  _write_text(os.path.join(out, "kit.md"), kit_markdown(rows, steps))
  if raw and os.listdir(raw):
    with tarfile.open(os.path.join(out, "raw.tar.gz.tmp"), "w:gz") as tar:
      for name in sorted(os.listdir(raw)):
        tar.add(os.path.join(raw, name), arcname=name)
    os.replace(os.path.join(out, "raw.tar.gz.tmp"), os.path.join(out, "raw.tar.gz"))


# ---------------------------------------------------------------- predicted beside measured

def predict(hlo_text: str, device_kind: str, point: dict, trace_path: str | None) -> dict | None:
  """The time model's prediction of the program a point ran, on the device's target (None for a
  device the model has no target for), with the per-class comparison against the point's profile
  (`bench/model_check.compare`) when its trace came back."""
  from micse_jax.aot import hlo_module, time_model
  from micse_jax.bench import model_check
  target = next((t for t in ("h100", "h200", "a100", "v100") if t in (device_kind or "").lower()), None)
  if target is None:
    return None
  members = point.get("members") or 1
  graphs = point.get("cuda_graphs", "xla")  # points measured before mesh.cuda_graphs ran XLA's default
  result = {k: v for k, v in time_model.predict(hlo_module.parse(hlo_text), target, top=0, members=members, cuda_graphs=graphs).items()
            if k in PREDICTED_KEYS}
  if trace_path and os.path.isfile(trace_path):
    check = model_check.compare(hlo_text, trace_path, point["profile"]["profiled_steps"], target,
                                point.get("pipelined_step_ms"), point.get("blocked_step_ms"), graphs)
    result["model_check"] = check
  return result


def _slug(device: str | None) -> str:
  found = re.search(r"\b([A-Z]\d{2,4})\b", device or "")
  return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "-", (device or "unknown").lower()).strip("-")


def install(folders: list[str], docs: str, commit: str | None, raw_to: str | None) -> str:
  """Merges returned folders into docs/<device>-<date>-<commit>/summary.{md,json}; returns that folder."""
  rows = read_rows([os.path.join(f, ROWS_FILE) for f in folders])
  raw = raw_to or tempfile.mkdtemp(prefix="micse_kit_raw_")
  os.makedirs(raw, exist_ok=True)
  for tar in (os.path.join(f, "raw.tar.gz") for f in folders):
    if os.path.isfile(tar):
      with tarfile.open(tar) as t:
        t.extractall(raw, filter="data")
  s = summary(rows)
  s["commit"] = commit or s["commit"] or _git_commit()
  for p in (p for p in s["points"] if p["ok"]):
    hlo = os.path.join(raw, f"{p['name']}.hlo.txt.gz")
    if os.path.isfile(hlo):
      text = gzip.open(hlo, "rt", encoding="utf-8").read()
      p["predicted"] = predict(text, s["device"], p, os.path.join(raw, f"{p['name']}.trace.json.gz"))
  target = os.path.join(docs, f"{_slug(s['device'])}-{s['date']}-{s['commit']}")
  os.makedirs(target, exist_ok=True)
  jsonio.write_json(os.path.join(target, "summary.json"), s)
  _write_text(os.path.join(target, "summary.md"), summary_markdown(s))
  return target


def benchmarks_rows(s: dict) -> list[str]:
  """Rows for BENCHMARKS.md's GPU table (pipelined; blocked in brackets)."""
  out = []
  for p in (p for p in s["points"] if p["ok"]):
    peers = "; ".join(f"{mode} PyTorch {p[f'torch_{mode}']['pipelined_step_ms']:.2f} ms ({p[f'ratio_torch_{mode}']:.2f}x)"
                      for mode in TORCH_MODES if p.get(f"torch_{mode}"))
    pred = (p.get("predicted") or {}).get("predicted_step_ms")
    out.append(f"| {s['device']} | {label(p)} | {p['pipelined_step_ms']:.2f} ({p['blocked_step_ms']:.2f}) "
               f"| {_pct(p.get('mfu'))} | {_f(pred, '.2f')} | {peers or '—'} | {s['commit']} |")
  return out


def main(argv=None) -> None:
  """`install`: see the module docstring."""
  p = argparse.ArgumentParser(prog="python -m benchmarks.kit_report", description=__doc__.splitlines()[0])
  p.add_argument("command", choices=("install",))
  p.add_argument("folders", nargs="+", help="the returned folders (files_at of each command), in order")
  p.add_argument("--docs", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                "docs", "calibration"))
  p.add_argument("--commit", help="the commit the kit ran (default: the rows', else this checkout's HEAD)")
  p.add_argument("--raw_to", help="also unpack each point's HLO and trace here (not into the repository)")
  args = p.parse_args(argv)
  if not any(glob.glob(os.path.join(f, ROWS_FILE)) for f in args.folders):
    p.error(f"no {ROWS_FILE} in {', '.join(args.folders)}")
  target = install(args.folders, args.docs, args.commit, args.raw_to)
  print(f"wrote {target}/summary.md and summary.json")
  print("BENCHMARKS.md rows (| device | point | pipelined ms (blocked) | MFU | predicted ms | PyTorch peers | commit |):")
  print("\n".join(benchmarks_rows(jsonio.read_json(os.path.join(target, "summary.json")))))


if __name__ == "__main__":
  main()
