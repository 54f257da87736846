"""A call's chunk of K steps as one loop over its batches, run the same way for every K (`repeated`), so
that K steps in one call equal K calls bit for bit (`steps_per_dispatch`, `training/dispatch.py`)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.xla_metadata import set_xla_metadata

# XLA's while-loop simplifier leaves a one-trip loop carrying this frontend attribute as a loop (`repeated`)
SKIP_TRIP_COUNT_ONE = "skip-simplify-while-loops_trip-count-one"


def repeated(step: Callable, carry, chunk):
  """`step(carry, x) -> (carry, y)` on each row of the chunk → (carry, the last step's y): a loop,
  also for a chunk of one step, every call running the step as the same loop body.

  XLA compiles code differently where it can tell more: a loop of one trip would be replaced by its
  body (compiled as top-level code), a chunk's row read from a one-row chunk is the chunk itself, and
  a y would be fused into its row of a stacked output. Each changes how the step's fusions are formed,
  and with them the order of some sums (a last bit): a run of one step per call would not be the run
  of K. So the one-trip loop is kept (XLA's frontend attribute `SKIP_TRIP_COUNT_ONE`), each step reads
  its batch from the loop's carry (read from the chunk by the step before, or before the loop for the
  first), and its y is carried, not stacked. The loop logs only steps that end a call
  (`dispatch.plan`), so the last step's y is all it reads."""
  rows = chunk.shape[0]
  last = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(step, carry, chunk[0])[1])

  def body(loop, i):
    state, _, x = loop
    upcoming = jax.lax.dynamic_index_in_dim(chunk, jnp.minimum(i + 1, rows - 1), keepdims=False)
    return (*step(state, x), upcoming), None
  (carry, last, _), _ = set_xla_metadata(jax.lax.scan(body, (carry, last, chunk[0]), jnp.arange(rows)),
                                         **{SKIP_TRIP_COUNT_ONE: "true"})
  return carry, last
