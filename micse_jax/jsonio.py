"""The one JSON writer: atomic (temporary file beside the target, fsync, rename)."""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Mapping


def plain(value):
  """JSON-safe copy: NumPy scalars/arrays to Python, non-finite floats to None."""
  if isinstance(value, Mapping):
    return {str(k): plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [plain(v) for v in value]
  if hasattr(value, "tolist"):
    return plain(value.tolist())
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def write_json(path: str, document: Any, *, sort_keys: bool = False) -> None:
  """Writes `document` so that `path` is either the old file or the complete new one."""
  folder = os.path.dirname(os.path.abspath(path))
  text = json.dumps(plain(document), indent=2, sort_keys=sort_keys, default=str) + "\n"
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


def read_json(path: str) -> Any:
  """The parsed JSON document at `path`."""
  with open(path, encoding="utf-8") as f:
    return json.load(f)
