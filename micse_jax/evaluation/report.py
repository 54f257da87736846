"""Evaluation reports: atomically written JSON and Markdown tables in the paper's column order."""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Mapping

STS_COLUMNS = (("STS12", "STS12"), ("STS13", "STS13"), ("STS14", "STS14"), ("STS15", "STS15"),
               ("STS16", "STS16"), ("STSBenchmark", "STS-B"), ("SICKRelatedness", "SICK-R"))
TRANSFER_COLUMNS = (("MR", "MR"), ("CR", "CR"), ("SUBJ", "SUBJ"), ("MPQA", "MPQA"),
                    ("SST2", "SST2"), ("TREC", "TREC"), ("MRPC", "MRPC"))


def build_report(results: Mapping[str, Any], *, model: str | None = None,
                 pooler: str | None = None, settings: Mapping[str, Any] | None = None,
                 elapsed_seconds: float | None = None) -> dict:
  """The JSON document: model, pooler, settings, elapsed time and the `run_evaluation` results."""
  report = {"model": model, "pooler": pooler, "settings": dict(settings or {}),
            "elapsed_seconds": elapsed_seconds}
  report.update({key: value for key, value in results.items() if key not in report})
  return report


def _plain(value):
  """JSON-safe copy: NumPy scalars/arrays to Python, non-finite floats to None."""
  if isinstance(value, Mapping):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if hasattr(value, "tolist"):
    return _plain(value.tolist())
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def write_json(path: str, document: Mapping[str, Any]) -> None:
  """Writes JSON to a temporary file beside `path`, then renames it: never a half-written file."""
  folder = os.path.dirname(os.path.abspath(path))
  text = json.dumps(_plain(document), indent=2, sort_keys=False) + "\n"
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def _cell(value) -> str:
  return "-" if value is None else f"{value:.2f}"


def _group_table(group: Mapping[str, Any] | None, columns, metric: str) -> str:
  """One table (header, rule, one row) for `{'tasks': ..., 'avg': ...}`; '-' for tasks not run."""
  tasks = (group or {}).get("tasks", {})
  header = [label for _, label in columns] + ["Avg."]
  row = [_cell(tasks[name][metric]) if name in tasks else "-" for name, _ in columns]
  row.append(_cell((group or {}).get("avg")))
  return "\n".join(["| " + " | ".join(header) + " |",
                    "|" + "|".join("---:" for _ in header) + "|",
                    "| " + " | ".join(row) + " |"])


def markdown_table(results: Mapping[str, Any]) -> str:
  """STS (Spearman x100) and transfer (accuracy) tables for whichever groups were run."""
  parts = []
  if results.get("sts"):
    parts.append("STS (Spearman x100)\n\n" + _group_table(results["sts"], STS_COLUMNS,
                                                              "spearman"))
  if results.get("transfer"):
    parts.append("Transfer (accuracy)\n\n" + _group_table(results["transfer"],
                                                            TRANSFER_COLUMNS, "acc"))
  return "\n\n".join(parts)
