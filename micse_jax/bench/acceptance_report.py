"""The acceptance report: rows of acceptance.jsonl → acceptance.json + acceptance.md.

Projected paper full-run time: miCSE trains one epoch of SimCSE's 1M Wikipedia sentences at
batch 50, 20,000 steps. A point at batch B is projected to the same 1M sentences,
ceil(1e6 / B) steps × its median step time: the train step only (no dev evaluation, checkpoint
saves or host time, which the trainer overlaps or amortises), on one device.
"""
from __future__ import annotations

import math
import os

from micse_jax.bench.rows import read_json_lines, write_json_atomically

PAPER_SENTENCES = 1_000_000  # = 20,000 steps x batch 50
ASSUMPTION = ("projected paper run = ceil(1,000,000 / batch) steps (the paper's 20,000 steps at batch 50: "
              "one epoch of wiki1m) x the median step time; step only: no dev evaluation, checkpoints "
              "or host time; one device")


def read_rows(paths: list[str]) -> list[dict]:
  """The rows of every existing acceptance.jsonl among `paths`, in order."""
  return [r for p in paths if os.path.isfile(p) for r in read_json_lines(p)]


def bench_point(row: dict) -> dict:
  """One grid point's figures (None where the point did not get that far)."""
  r = row.get("result") or {}
  j, t, tc = r.get("jax") or {}, r.get("torch") or {}, r.get("torch_compiled") or {}
  step_ms = j.get("step_ms")
  projected_h = (math.ceil(PAPER_SENTENCES / row["batch_size"]) * step_ms / 3.6e6) if step_ms else None
  return {"dtype": row["dtype"], "batch_size": row["batch_size"], "ok": row.get("ok"),
          "status": "ok" if row.get("ok") else str(row.get("returncode")), "device": r.get("device"),
          "compile_s": r.get("compile_s"), "step_ms": step_ms, "sentences_per_s": j.get("sentences_per_s"),
          "mfu": j.get("mfu"), "peak_device_bytes": j.get("peak_device_bytes"),
          "torch_step_ms": t.get("step_ms"), "torch_peak_device_bytes": t.get("peak_device_bytes"),
          "ratio_torch_over_jax": r.get("speedup_vs_torch"), "torch_compiled_step_ms": tc.get("step_ms"),
          "ratio_torch_compiled_over_jax": r.get("speedup_vs_torch_compiled"), "projected_paper_run_hours": projected_h,
          "profile_ms_per_step_by_kind": (r.get("profile") or {}).get("ms_per_step_by_kind"),
          "kernels_per_step": r.get("kernels_per_step"), "update_kernels_per_step": r.get("update_kernels_per_step")}


def summary(rows: list[dict]) -> dict:
  """The JSON report: bench points, test counts, the training row, assumptions, raw rows."""
  return {"assumption": ASSUMPTION, "dry": any(r.get("dry") for r in rows),
          "kit_imports": [r for r in rows if r.get("row") == "kit_imports"],
          "gpu_tests": [r for r in rows if r.get("row") == "gpu_tests"],
          "bench": [bench_point(r) for r in rows if r.get("row") == "bench"],
          "train": [r for r in rows if r.get("row") == "train"],
          "host": [r for r in rows if r.get("row") == "host"],
          "model_caches": [r for r in rows if r.get("row") == "model_caches"],
          "aot": [r for r in rows if r.get("row") == "aot"],
          "encode_attention": [r for r in rows if r.get("row") == "encode_attention"],
          "population": [r for r in rows if r.get("row") == "population"], "rows": rows}


def _f(x, fmt: str) -> str:
  return "—" if x is None else format(x, fmt)


def _gib(b) -> str:
  return "—" if b is None else f"{b / 2 ** 30:.2f}"


def markdown(rows: list[dict]) -> str:
  """The human-readable report."""
  s = summary(rows)
  lines = ["# micse_jax GPU acceptance report" + (" (CPU dry run: tiny shapes, not figures)" if s["dry"] else ""), ""]
  for k in s["kit_imports"]:
    lines.append(f"- the kit's packages import: {'ok' if k['ok'] else 'FAILED: ' + ', '.join(k['failed'])}")
  for c in s["model_caches"]:
    caches = "; ".join(f"{d} {v['bytes'] / 2 ** 20:.0f} MiB ({', '.join(v['entries'][:12]) or 'empty'})"
                       for d, v in c["caches"].items())
    lines.append(f"- model caches on the image: {caches or 'none'}")
  for t in s["gpu_tests"]:
    lines.append(f"- tests marked `gpu`: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, "
                 f"{t['skipped']} skipped ({'ok' if t['ok'] else 'FAILED, exit ' + str(t['returncode'])})")
  if s["bench"]:
    device = next((b["device"] for b in s["bench"] if b["device"]), "?")
    lines += ["", f"## Train step: micse_jax vs PyTorch ({device})", "",
              "| dtype | batch | status | compile s | step ms | sentences/s | MFU | peak GiB | PyTorch ms "
              "| PyTorch peak GiB | PyTorch / micse_jax | compiled PyTorch ms | compiled PyTorch / micse_jax "
              "| projected paper run (h) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in s["bench"]:
      mfu = "—" if b["mfu"] is None else f"{100 * b['mfu']:.1f}%"
      lines.append(f"| {b['dtype']} | {b['batch_size']} | {b['status']} | {_f(b['compile_s'], '.1f')} "
                   f"| {_f(b['step_ms'], '.2f')} | {_f(b['sentences_per_s'], '.0f')} | {mfu} "
                   f"| {_gib(b['peak_device_bytes'])} | {_f(b['torch_step_ms'], '.2f')} "
                   f"| {_gib(b['torch_peak_device_bytes'])} | {_f(b['ratio_torch_over_jax'], '.2f')} "
                   f"| {_f(b['torch_compiled_step_ms'], '.2f')} | {_f(b['ratio_torch_compiled_over_jax'], '.2f')} "
                   f"| {_f(b['projected_paper_run_hours'], '.2f')} |")
    lines += ["", f"Projection: {ASSUMPTION}."]
    for b in s["bench"]:
      if b["profile_ms_per_step_by_kind"]:
        kinds = ", ".join(f"{k} {v:.2f} ms" for k, v in b["profile_ms_per_step_by_kind"].items())
        lines.append(f"Profile ({b['dtype']}, batch {b['batch_size']}), per step by kind: {kinds}.")
  for a in s["aot"]:
    lines += ["", "## `--aot h100` prediction beside the measured step", ""] + aot_lines(a, s["bench"])
  for p in s["population"]:
    lines += ["", "## Population training (issue 27)", ""] + population_lines(p)
  for e in s["encode_attention"]:
    r = e.get("result") or {}
    lines += ["", "## Encode: fused (cuDNN flash) attention against the explicit softmax", "",
              f"FAILED ({e.get('returncode')})" if not e.get("ok") else
              f"{r['dtype']}, {r['sentences']} sentences, batch {r['batch_size']}: fused "
              f"{r['fused_sentences_per_s']:.0f} sentences/s with {r['cudnn_attention_calls']} cuDNN attention calls "
              f"in its program, explicit {r['explicit_sentences_per_s']:.0f} sentences/s: "
              f"**{r['speedup_fused_over_explicit']:.2f}x**; largest embedding difference {r['max_abs_difference']:.2g}."]
  for t in s["train"]:
    tasks = " ".join(f"{k} {_f(v, '.2f')}" for k, v in t["sts"].items())
    lines += ["", f"## miCSE training ({t['model']}, {t['steps']} steps, batch {t['batch_size']})", "",
              f"{'ok' if t['ok'] else 'FAILED (' + str(t['returncode']) + ')'}: {t['seconds']:.0f} s wall "
              f"(start-up, compile, dev evaluation and STS7 included); STS7 Spearman x100: "
              f"{tasks or '—'}; avg {_f(t['sts_avg'], '.2f')}"]
  for h in s["host"]:
    lines += ["", "## Host side (this machine's CPU; batches placed on its accelerator)", ""] + host_lines(h)
  failed = [r for r in rows if not r.get("ok") and r.get("tail")]
  if failed:
    lines += ["", "## Failures (output tails in acceptance.json)", ""]
    lines += [f"- {r.get('row')} {r.get('dtype', '')} {r.get('batch_size', '')}: {r.get('returncode')}" for r in failed]
  return "\n".join(lines) + "\n"


def aot_lines(row: dict, points: list[dict]) -> list[str]:
  """The deviceless compile's prediction and the measured grid point of the same dtype and batch."""
  r = row.get("result") or {}
  if not row.get("ok"):
    return [f"FAILED ({row.get('returncode')})"]
  measured = next((b for b in points if b["dtype"] == r["dtype"] and b["batch_size"] == r["batch_size"]), None)
  lines = [f"{r['dtype']}, batch {r['batch_size']} ({r['model']}, compiled here for {r['device_kind']} without "
           "the device, no autotuning):", "",
           "| | kernels per step | update kernels | peak GiB | step ms |", "|---|---|---|---|---|",
           f"| `--aot h100` prediction | {r['kernels_per_step']} | {r['update_kernels_per_step']} "
           f"| {_gib(r['peak_bytes_per_device'])} | — |"]
  if measured:
    lines.append(f"| measured ({measured['device']}) | {_f(measured['kernels_per_step'], 'd')} "
                 f"| {_f(measured['update_kernels_per_step'], 'd')} | {_gib(measured['peak_device_bytes'])} "
                 f"| {_f(measured['step_ms'], '.2f')} |")
  return lines


FEWSHOT_GOAL_HOURS = 3.0  # issue 27: the paper's few-shot protocol in at most 3 H100-hours


def population_lines(row: dict) -> list[str]:
  """Member-steps per second per population size and the few-shot protocol's projected hours."""
  r = row.get("result") or {}
  if not row.get("ok") or not r.get("population"):
    return [f"Not measured ({row.get('returncode')}). {row.get('tail', '')[-300:]}".strip()]
  lines = [f"{r.get('model')}, batch {r.get('batch_size')}, {r.get('dtype')}, {r.get('device')}:", "",
           "| members K | first call s | ms per population step | member-steps/s | gain over K=1 | peak GiB |",
           "|---|---|---|---|---|---|"]
  for m in r["population"]:
    lines.append(f"| {m['members']} | {m['first_call_s']:.1f} | {m['ms_per_population_step']:.2f} "
                 f"| {m['member_steps_per_s']:.1f} | {_f(m.get('gain_over_solo'), '.2f')} "
                 f"| {_gib(m.get('peak_device_bytes'))} |")
  lines += ["", f"Few-shot protocol projected ({r.get('fewshot_counted')}); goal <= {FEWSHOT_GOAL_HOURS:g} "
                "H100-hours:", "", "| K | programs | steps h | compiles h | total h | goal |", "|---|---|---|---|---|---|"]
  for p in r.get("fewshot_projection") or []:
    lines.append(f"| {p['members']} | {p['programs']} | {p['step_hours']:.2f} | {p['compile_hours']:.2f} "
                 f"| {p['hours']:.2f} | {'met' if p['hours'] <= FEWSHOT_GOAL_HOURS else 'not met'} |")
  return lines


def host_lines(row: dict) -> list[str]:
  """The host row (`python -m micse_jax.bench --host`'s output file) as Markdown lines."""
  if not row.get("ok"):
    return [f"FAILED ({row.get('returncode')})"]
  per_step, dev = row["result"]["host_ms_per_step"], row["result"].get("dev_selection")
  batches = next(iter(per_step.values()))
  lines = ["| host ms per step (batch + placement) | " + " | ".join(f"batch {b}" for b in batches) + " |",
           "|---|" + "---|" * len(batches)]
  lines += [f"| {source} corpus | " + " | ".join(f"{ms:.3f}" for ms in sizes.values()) + " |"
            for source, sizes in per_step.items()]
  if dev:
    lines += ["", f"Dev selection: one STS-B dev evaluation ({dev['dev_sentences']} sentences) "
              f"{dev['dev_eval_ms']:.1f} ms against {dev['eval_every']} train steps of {dev['step_ms']:.2f} ms: "
              f"**{100 * dev['fraction_of_step_time']:.2f} %** of step time."]
  return lines


def write(out: str, jsonl_paths: list[str]) -> str:
  """Rewrites out/acceptance.json and out/acceptance.md from the rows; returns the Markdown."""
  rows = read_rows(jsonl_paths)
  text = markdown(rows)
  write_json_atomically(os.path.join(out, "acceptance.json"), summary(rows))
  tmp = os.path.join(out, "acceptance.md.tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, os.path.join(out, "acceptance.md"))
  return text
