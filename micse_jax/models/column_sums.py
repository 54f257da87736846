"""Sums over an activation's rows (a bias's gradient, a LayerNorm's dγ and dβ) in two stages on CUDA.

The gradient of a bias broadcast over rows, and of a LayerNorm's scale and shift, is a column sum:

  dβ_c = Σ_r g_rc   over the R·N rows of a [rows, C] activation (rows = batch × tokens).

XLA's GPU column reduction gives each block of columns every row, so with C ≤ a few thousand
columns (BERT's 768 and 3072) the reduction has too few blocks to keep the memory system busy:
it streams at about a quarter of peak bandwidth where other reductions reach more than half
(`aot/time_model.NARROW_COLUMNS_EFFICIENCY`). In two stages the rows are cut into R chunks of N,

  p_kc = Σ_{n<N} g_(kN+n)c   (R·C outputs: R times the blocks),   dβ_c = Σ_k p_kc,

float32 partial sums, the second stage reading R·C values instead of rows·C. Under data
parallelism the step sees the whole batch's rows while each device sums its own 1/D of them: the
chunks are fitted to a device's rows (`RowSums.devices`, the model's `Policy.row_split`), R = D·R_d,
so every device's first stage writes R_d·C sums and its chunks never cross into another device's
rows; R fitted to the whole batch would leave each device R/D, a narrow reduction again. The sum
is the same up to the order of float32 additions. Only where it pays (`RowSums.two_stage`, chosen
from the program's target by `kernels/choice.own_gradients`: a CUDA target, a deviceless one
included): XLA:CPU sums rows in loops that chunks do not speed up, and keeps one plain sum in the
values' own dtype, as autodiff computes it.

`add_bias(y, bias, sums)` is `y + bias` whose bias gradient is `column_sums`;
`column_sums(*values, sums=RowSums(...))` sums several arrays of one shape in one (variadic) reduction.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from micse_jax.kernels.choice import OWN_GRADIENT_SCOPE

Array = jax.Array

CHUNK_OUTPUTS = 32768  # partial sums to aim for: twice the outputs below which the reduction is narrow
MIN_CHUNK_ROWS = 16    # shorter chunks make the second stage the larger read


@dataclasses.dataclass(frozen=True)
class RowSums:
  """How a gradient's sums over rows are computed (module docstring): in two float32 stages
  (`two_stage`: CUDA) with chunks fitted to `devices` devices' rows, or as one plain reduction."""
  two_stage: bool = False
  devices: int = 1


def chunks(rows: int, columns: int, devices: int = 1) -> int:
  """R = D·R_d for `rows` split evenly over D = `devices`: R_d the smallest divisor of a device's rows
  with R_d · `columns` >= CHUNK_OUTPUTS and chunks of at least MIN_CHUNK_ROWS rows; 1 (a plain sum)
  when no divisor qualifies. Rows the devices do not divide are chunked as one device's."""
  if devices < 1 or rows % devices:
    devices = 1
  local = rows // devices
  for r in range(2, local // MIN_CHUNK_ROWS + 1):
    if local % r == 0 and r * columns >= CHUNK_OUTPUTS:
      return r * devices
  return 1


def variadic_sum(values: tuple[Array, ...], axes: tuple[int, ...]) -> tuple[Array, ...]:
  """Σ over `axes` of each of `values` (one shape), as one variadic reduction (one kernel)."""
  axes = tuple(a % values[0].ndim for a in axes)
  zeros = tuple(jnp.zeros((), v.dtype) for v in values)
  return jax.lax.reduce(values, zeros, lambda a, b: tuple(x + y for x, y in zip(a, b)), axes)


def _plain(*values: Array) -> tuple[Array, ...]:
  return variadic_sum(values, tuple(range(values[0].ndim - 1)))


def _two_stage(*values: Array, devices: int = 1) -> tuple[Array, ...]:
  columns = values[0].shape[-1]
  rows = values[0].size // max(columns, 1)
  r = chunks(rows, columns, devices)
  if r == 1:
    return _plain(*values)
  wide = tuple(v.astype(jnp.float32).reshape(r, rows // r, columns) for v in values)
  # The barrier keeps XLA's algebraic simplifier from folding the two sums back into one.
  partial = jax.lax.optimization_barrier(variadic_sum(wide, (1,)))
  return tuple(s.astype(v.dtype) for s, v in zip(variadic_sum(partial, (0,)), values))


def column_sums(*values: Array, sums: RowSums = RowSums()) -> tuple[Array, ...]:
  """Σ over every axis but the last of each of `values` (one shape), as `sums` says (module docstring):
  in two float32 stages fitted to `sums.devices` devices' rows, or one plain reduction."""
  if not sums.two_stage:
    return _plain(*values)
  with jax.named_scope(OWN_GRADIENT_SCOPE):  # a CUDA gradient of ours (`kernels/choice.OWN_MARKS`)
    return _two_stage(*values, devices=sums.devices)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def add_bias(y: Array, bias: Array, sums: RowSums = RowSums()) -> Array:
  """y + bias (broadcast over y's leading axes); the bias's gradient by `column_sums` as `sums` says."""
  return y + bias


def _add_bias_forward(y, bias, sums):
  return y + bias, None


def _add_bias_backward(sums, _, g):
  return g, column_sums(g, sums=sums)[0]


add_bias.defvjp(_add_bias_forward, _add_bias_backward)
