"""Sweep results: mean ± std over seeds per method × size (× other axes), as JSON, Markdown, CSV,
and the runs' seconds per phase (`timeline.json`: sum and mean over the sweep's runs).

The std is the sample standard deviation over the finished seeds (ddof = 1, as papers report
seed spread); with one finished seed it is undefined and shown as "-". `n` is the number of
finished seeds of the row; failed or unfinished runs are listed separately, never averaged in.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os

import numpy as np

from micse_jax import timeline
from micse_jax.evaluation.report import STS_COLUMNS, TRANSFER_COLUMNS
from micse_jax.jsonio import read_json, write_json
from micse_jax.studies.runner import read_status
from micse_jax.studies.spec import RunSpec, method_name

RESULTS_FILE = "results.json"
TIMELINE_FILE = "timeline.json"  # a run's seconds per phase (`micse_jax/timeline.py`, `workdir.TIMELINE_FILE`)


def mean_std(values) -> tuple[float | None, float | None]:
  """Mean and sample std (ddof=1) of the finite values; std None for fewer than two."""
  vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
  if not vals:
    return None, None
  return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else None)


def _scores(document: dict) -> dict[str, float]:
  """{'STS12': ..., 'sts_avg': ..., 'MR': ..., 'transfer_avg': ...} from a run's results.json."""
  out = {}
  for group, metric in (("sts", "spearman"), ("transfer", "acc")):
    part = document.get(group) or {}
    for task, result in (part.get("tasks") or {}).items():
      out[task] = result.get(metric)
    if part.get("avg") is not None:
      out[f"{group}_avg"] = part["avg"]
  return out


def _run_corpus_size(run: RunSpec, cache: dict) -> int | None:
  """Training-set size of a run that uses the whole corpus (data.num_sentences = 0)."""
  path = os.path.join(run.workdir, "config.json")
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    corpus = json.load(f)["data"]["corpus"]
  if corpus not in cache:
    from micse_jax.data.prepared import corpus_size  # JAX, TFDS: only when a run's corpus is read
    cache[corpus] = corpus_size(corpus) if os.path.exists(corpus) else None
  return cache[corpus]


def collect(runs: list[RunSpec]) -> tuple[list[dict], list[dict]]:
  """(rows, problems): one row per group of runs differing only by seed, in sweep order."""
  groups: dict[tuple, list] = {}
  problems, sizes = [], {}
  for run in runs:
    key = tuple((k, v) for k, v in run.labels if k != "seed")
    groups.setdefault(key, [])
    status = read_status(run.workdir)
    results = os.path.join(run.workdir, RESULTS_FILE)
    if status.get("status") == "done" and os.path.isfile(results):
      with open(results, encoding="utf-8") as f:
        groups[key].append((run, _scores(json.load(f))))
    else:
      problems.append({"run": run.name, "status": status.get("status", "not run"),
                       "error": status.get("error")})
  rows = []
  for key, finished in groups.items():
    labels = dict(key)
    first_run = next(r for r in runs if tuple((k, v) for k, v in r.labels if k != "seed") == key)
    size = int(first_run.override("data.num_sentences", 0) or 0)
    row = {"method": method_name(first_run.config_file), **{k: v for k, v in labels.items() if k != "method"},
           "num_sentences": size if size > 0 else _run_corpus_size(first_run, sizes) if finished else None,
           "all_sentences": size <= 0, "n": len(finished), "seeds": [r.label("seed") for r, _ in finished],
           "scores": {}}
    names = sorted({name for _, scores in finished for name in scores})
    for name in names:
      mean, std = mean_std(s.get(name) for _, s in finished)
      row["scores"][name] = {"mean": mean, "std": std, "values": [s.get(name) for _, s in finished]}
    rows.append(row)
  return rows, problems


def time_per_phase(runs: list[RunSpec]) -> dict:
  """Seconds per phase over the runs that wrote `timeline.json` (finished or not): per key of
  `timeline.KEYS` the sum and mean over those runs, `n` runs, and `runs` naming them."""
  documents = {}
  for run in runs:
    path = os.path.join(run.workdir, TIMELINE_FILE)
    if os.path.isfile(path):
      try:
        documents[run.name] = read_json(path)
      except (OSError, ValueError):
        continue
  phases = {}
  for key in timeline.KEYS:
    values = [float(d.get(key) or 0.0) for d in documents.values()]
    phases[key] = {"sum": round(sum(values), 3), "mean": round(sum(values) / len(values), 3) if values else None}
  return {"n": len(documents), "runs": sorted(documents), "phases": phases}


def _time_lines(times: dict) -> list[str]:
  """results.md's table of seconds per phase (sum and mean over the runs with a timeline)."""
  if not times or not times["n"]:
    return []
  keys = timeline.KEYS
  return ["", f"Seconds per phase over the {times['n']} runs with a `timeline.json` (compiles counted apart; "
          "a resumed run sums its sessions):", "",
          "| | " + " | ".join(k[:-2] for k in keys) + " |", "|---|" + "---:|" * len(keys),
          "| sum | " + " | ".join(f"{times['phases'][k]['sum']:.1f}" for k in keys) + " |",
          "| mean | " + " | ".join(f"{times['phases'][k]['mean']:.1f}" for k in keys) + " |"]


def _columns(rows: list[dict]) -> list[tuple[str, str]]:
  """(score key, header) of the scores present in any row, in the paper's order."""
  present = {name for row in rows for name in row["scores"]}
  columns = [(k, label) for k, label in STS_COLUMNS if k in present]
  if "sts_avg" in present:
    columns.append(("sts_avg", "STS Avg."))
  columns += [(k, label) for k, label in TRANSFER_COLUMNS if k in present]
  if "transfer_avg" in present:
    columns.append(("transfer_avg", "Transfer Avg."))
  return columns


def _label_keys(rows: list[dict]) -> list[str]:
  fixed = {"method", "num_sentences", "all_sentences", "n", "seeds", "scores"}
  return [k for k in rows[0] if k not in fixed] if rows else []


def _size_text(row: dict) -> str:
  if row["all_sentences"]:
    return f"all ({row['num_sentences']})" if row["num_sentences"] else "all"
  return str(row["num_sentences"])


def _cell(score: dict | None) -> str:
  if not score or score["mean"] is None:
    return "-"
  return f"{score['mean']:.2f} ± {score['std']:.2f}" if score["std"] is not None else f"{score['mean']:.2f} ± -"


def markdown(rows: list[dict], problems: list[dict], name: str, times: dict | None = None) -> str:
  """results.md: one table row per (method, labels, size), mean ± std over seeds, then the problems."""
  columns, extra = _columns(rows), [k for k in _label_keys(rows) if k != "data.num_sentences"]
  header = ["method", *extra, "sentences", "seeds"] + [label for _, label in columns]
  lines = [f"# Sweep `{name}`", "",
           "Mean ± sample std (ddof=1) over the finished seeds; `seeds` = number finished. "
           "STS: Spearman x100 (cosine, [CLS] before the MLP); transfer: accuracy.", "",
           "| " + " | ".join(header) + " |", "|" + "|".join(["---"] * (len(extra) + 3) + ["---:"] * len(columns)) + "|"]
  for row in rows:
    cells = [row["method"], *(str(row.get(k)) for k in extra), _size_text(row), str(row["n"])]
    cells += [_cell(row["scores"].get(key)) for key, _ in columns]
    lines.append("| " + " | ".join(cells) + " |")
  if problems:
    lines += ["", "Runs not counted:", ""]
    lines += [f"- `{p['run']}`: {p['status']}" + (f" — {p['error']}" if p.get("error") else "") for p in problems]
  lines += _time_lines(times)
  return "\n".join(lines) + "\n"


def csv_text(rows: list[dict]) -> str:
  """results.csv: the same rows as `markdown`, one column per statistic."""
  columns, extra = _columns(rows), _label_keys(rows)
  buffer = io.StringIO()
  writer = csv.writer(buffer)
  writer.writerow(["method", *extra, "num_sentences", "all_sentences", "n_seeds"]
                  + [f"{key}_{stat}" for key, _ in columns for stat in ("mean", "std")])
  for row in rows:
    scores = [row["scores"].get(key, {}).get(stat) for key, _ in columns for stat in ("mean", "std")]
    writer.writerow([row["method"], *(row.get(k) for k in extra), row["num_sentences"], row["all_sentences"],
                     row["n"]] + ["" if v is None else f"{v:.6g}" for v in scores])
  return buffer.getvalue()


def write_reports(runs: list[RunSpec], sweep_dir: str, name: str) -> dict:
  """Writes results.json / results.md / results.csv in `sweep_dir`; returns the JSON document."""
  rows, problems = collect(runs)
  times = time_per_phase(runs)
  document = {"sweep": name, "std": "sample (ddof=1) over finished seeds", "rows": rows, "not_counted": problems,
              "timeline": times}
  os.makedirs(sweep_dir, exist_ok=True)
  write_json(os.path.join(sweep_dir, "results.json"), document)
  for filename, text in (("results.md", markdown(rows, problems, name, times)), ("results.csv", csv_text(rows))):
    tmp = os.path.join(sweep_dir, filename + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
      f.write(text)
    os.replace(tmp, os.path.join(sweep_dir, filename))
  return document
