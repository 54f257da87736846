"""Cross-device collectives of a compiled step, read from its optimised HLO text.

`collective_table(jitted.lower(...).compile().as_text())` counts every collective
instruction by kind and adds up the bytes of its result (per device). An asynchronous pair
(`all-gather-start` / `all-gather-done`) is one collective: the `-done` half is counted, with
its result shape (the gathered / reduced array); the `-start` half is skipped. A collective
that a backend wraps in an `async-start` computation is counted once, where the wrapped
computation names it.
"""
from __future__ import annotations

import re

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                    "collective-permute")

# `%name = <result shape> <opcode>(` ; the shape may be a tuple `(f32[2]{0}, f32[8]{0})`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s+"
                          r"(?P<opcode>[a-z][a-z0-9\-]*)\(")
_ARRAY_SHAPE = re.compile(r"\b(?P<dtype>pred|token|[a-z]+\d+[a-z0-9]*)\[(?P<dims>[\d,]*)\]")


def _element_bits(dtype: str) -> int:
  """Bits per element of an HLO primitive type (`f32` 32, `bf16` 16, `pred` 8, `f8e4m3fn` 8)."""
  if dtype == "pred":
    return 8
  match = re.match(r"[a-z]+(\d+)", dtype)
  if match is None:
    raise ValueError(f"unknown HLO element type {dtype!r}")
  return int(match.group(1))


def shape_bytes(shape_text: str) -> int:
  """Bytes of an HLO result shape: one array `f32[8,16]{1,0}` or a tuple of arrays."""
  total_bits = 0
  for match in _ARRAY_SHAPE.finditer(shape_text):
    if match.group("dtype") == "token":
      continue
    elements = 1
    for dim in filter(None, match.group("dims").split(",")):
      elements *= int(dim)
    total_bits += elements * _element_bits(match.group("dtype"))
  return (total_bits + 7) // 8


def _collective_kind(opcode: str) -> str | None:
  """The collective kind an opcode counts as, or None (`-start` halves count as None)."""
  if opcode.endswith("-start"):
    return None
  base = opcode[:-len("-done")] if opcode.endswith("-done") else opcode
  return base if base in COLLECTIVE_KINDS else None


def collective_table(hlo_text: str) -> dict[str, dict[str, int]]:
  """Collectives of an optimised HLO module: {kind: {"count", "bytes", "max_bytes"}}.

  Every kind in `COLLECTIVE_KINDS` is present (zeros when absent). `bytes` sums, and
  `max_bytes` is the largest of, the per-device result sizes of that kind's instructions.
  """
  table = {kind: {"count": 0, "bytes": 0, "max_bytes": 0} for kind in COLLECTIVE_KINDS}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match is None:
      continue
    kind = _collective_kind(match.group("opcode"))
    if kind is None:
      continue
    size = shape_bytes(match.group("shape"))
    row = table[kind]
    row["count"] += 1
    row["bytes"] += size
    row["max_bytes"] = max(row["max_bytes"], size)
  return table
