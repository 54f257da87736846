"""Evaluation reports: atomically written JSON and Markdown tables in the paper's column order."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from micse_jax import jsonio

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


def write_json(path: str, document: Mapping[str, Any]) -> None:
  """Writes the report atomically (`micse_jax.jsonio.write_json`): never a half-written file."""
  jsonio.write_json(path, document)


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
    protocol = results["transfer"].get("protocol")
    title = f"Transfer (accuracy, {protocol} protocol)" if protocol else "Transfer (accuracy)"
    parts.append(title + "\n\n" + _group_table(results["transfer"], TRANSFER_COLUMNS, "acc"))
  return "\n\n".join(parts)
