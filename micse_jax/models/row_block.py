"""A forward pass over one block of a batch's rows that draws what the whole batch's pass would draw.

The cached-embedding step (`training/grad_cache.py`, GradCache) runs the encoder on a batch block by
block. Every random draw of a block's pass must be the whole batch's draw at the block's rows, so that
the blocked step computes the unblocked one. A `Block` says which rows those are; the layers read it
the way they read the `Policy` (`Block.applied`, `current`): the dropout sites draw the whole pass's
mask and keep the block's rows (`models/dropout.py`), the dropout-attention kernels draw their bits at
the block's row indices (`kernels/dropout_attention.py`).

The rows of a batch split over D devices lie in D equal contiguous parts, one per device. Each device
cuts its part into `count` equal blocks, and block `index` of the pass is the `index`-th block of every
device's part: no row crosses devices, and with one device it is rows `[index·r, (index+1)·r)`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Block:
  """Block `index` (an int32 scalar, traced in a loop) of `count` per device, rows split over `devices`."""
  index: Any
  count: int
  devices: int = 1

  def whole_rows(self, rows: int) -> int:
    """The whole pass's rows, for a block of `rows` (over all devices)."""
    return rows * self.count

  def of_whole(self, whole: jax.Array) -> jax.Array:
    """The block's rows (leading axis) of an array over the whole pass's rows."""
    rows = whole.shape[0] // (self.devices * self.count)
    parts = whole.reshape(self.devices, self.count, rows, *whole.shape[1:])
    block = jax.lax.dynamic_index_in_dim(parts, self.index, axis=1, keepdims=False)
    return block.reshape(self.devices * rows, *whole.shape[1:])

  def first_row(self, device: Any, rows_here: int) -> jax.Array:
    """The whole pass's index of the first of `rows_here` rows that `device` holds of the block."""
    return (jnp.asarray(device, jnp.int32) * self.count + jnp.asarray(self.index, jnp.int32)) * rows_here


def whole_of(blocks: jax.Array, devices: int) -> jax.Array:
  """The inverse of cutting: `[count, rows, ...]`, block i's rows at i (`Block.of_whole`), put back in
  the whole pass's row order `[count · rows, ...]`."""
  count, rows = blocks.shape[:2]
  parts = blocks.reshape(count, devices, rows // devices, *blocks.shape[2:])
  return jnp.swapaxes(parts, 0, 1).reshape(count * rows, *blocks.shape[2:])


def of_tree(block: Block | None, tree):
  """Every array of `tree` cut to the block's rows (`tree` itself without a block)."""
  return tree if block is None else jax.tree.map(block.of_whole, tree)


class _InEffect(threading.local):
  stack: list  # the blocks applied, innermost last (per thread: tracing runs on the caller's)

  def __init__(self):
    self.stack = []


_in_effect = _InEffect()


@contextlib.contextmanager
def applied(block: Block | None):
  """`block` in effect (`current`) for the layers applied inside; None: the whole batch."""
  _in_effect.stack.append(block)
  try:
    yield block
  finally:
    _in_effect.stack.pop()


def current() -> Block | None:
  """The block of the innermost `applied`, or None (the pass is over the whole batch)."""
  return _in_effect.stack[-1] if _in_effect.stack else None
