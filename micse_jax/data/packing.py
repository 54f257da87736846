"""One int32 array per host batch, so a step's batch is placed on the devices in one transfer.

A host batch is five int32 arrays (`input_ids`, `attention_mask`, `token_type_ids` `[rows, T]`,
`sentence_ids`, `row_mask` `[rows]`). Placing them one by one costs a host→device call each
(BENCHMARKS.md, "One transfer per step"); `BatchLayout.pack` puts them side by side as
columns of one `[rows, 3T + 2]` array, placed with one call and row-sharded like the batch it
holds, and `BatchLayout.unpack` slices the columns back inside the jitted step (free: column
slices of a row-sharded array stay on their devices, no communication).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """The keys of a host batch, in column order, with their widths (`None`: a 1-D key)."""
  keys: tuple[str, ...]
  widths: tuple[int | None, ...]

  @classmethod
  def of(cls, batch: Mapping[str, np.ndarray]) -> "BatchLayout":
    """The layout of `batch`: int32 arrays `[rows]` or `[rows, width]` with the same rows."""
    rows = {np.shape(v)[0] for v in batch.values()}
    bad = [k for k, v in batch.items() if np.asarray(v).dtype != np.int32 or np.ndim(v) not in (1, 2)]
    if bad or len(rows) != 1:
      raise ValueError(f"a packed batch needs int32 [rows] or [rows, width] arrays with equal rows; "
                       f"got {({k: (np.asarray(v).dtype.name, np.shape(v)) for k, v in batch.items()})}")
    keys = tuple(sorted(batch))
    return cls(keys, tuple(np.shape(batch[k])[1] if np.ndim(batch[k]) == 2 else None for k in keys))

  @property
  def columns(self) -> int:
    """Columns of the packed array."""
    return sum(1 if w is None else w for w in self.widths)

  def pack(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """int32 `[rows, columns]`: the keys' columns side by side in `keys` order."""
    if tuple(sorted(batch)) != self.keys:
      raise ValueError(f"batch keys {sorted(batch)} differ from the layout's {list(self.keys)}")
    parts = [np.asarray(batch[k], np.int32).reshape(len(batch[k]), -1) for k in self.keys]
    return np.concatenate(parts, axis=1)

  def unpack(self, packed):
    """The batch dict back from a packed NumPy or JAX array (column slices)."""
    out, start = {}, 0
    for key, width in zip(self.keys, self.widths):
      out[key] = packed[:, start] if width is None else packed[:, start:start + width]
      start += 1 if width is None else width
    return out
