"""Bench results that survive a late failure: each row printed and saved as soon as it is measured.

A bench run measures several things one after another (compile, the micse_jax step, the PyTorch
baseline, ...); any of them can fail late (out of memory, a missing package). `Rows.add` merges
one measured part into the run's result, prints its lines at once (flushed), appends it as one
JSON line to the rows file (flushed and fsync'd: a killed process keeps it) and rewrites the
output file with the result so far (`jsonio.write_json`: never half-written).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable

from micse_jax import jsonio

# Fields copied into every row of the rows file, so that each line says what it measured.
ROW_KEYS = ("model", "batch_size", "max_length", "dtype", "device")


def append_json_line(path: str, record: dict) -> None:
  """Appends `record` as one JSON line to `path`, flushed to disk before returning."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())


class Rows:
  """The result of one bench run, built up row by row (see the module docstring)."""

  def __init__(self, result: dict, rows_path: str | None = None, output_path: str | None = None):
    self.result = result
    self.rows_path, self.output_path = rows_path, output_path

  def add(self, row: str, lines: Callable[[dict], list[str]], **fields) -> None:
    """Merges `fields` into the result, prints `lines(result)`, saves the row and the result."""
    self.result.update(fields)
    print("\n".join(lines(self.result)), flush=True)
    sys.stderr.flush()
    if self.rows_path:
      ids = {k: self.result[k] for k in ROW_KEYS if k in self.result}
      append_json_line(self.rows_path, {"row": row, **ids, **fields})
    if self.output_path:
      jsonio.write_json(self.output_path, self.result)
