"""`nn.Dense` with its bias gradient summed in two stages on CUDA, and several of them as one GEMM.

`Dense` creates `nn.Dense`'s parameters (same names, shapes, dtype and initialisers) and computes
its values, x · kernel + bias in the compute dtype, the bias added by `column_sums.add_bias`
(`models/column_sums.py`), its gradient summed as the policy of the model applying it says
(`Policy.row_sums`: two stages fitted to each device's rows where it targets CUDA). `fused_dense`
applies several Dense layers of one input (BERT's query, key and value) as one GEMM over their
HF-named parameter sets.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from micse_jax.models import policy
from micse_jax.models.column_sums import add_bias

Array = jax.Array


def _dense_params(module: nn.Module, in_features: int, features: int, kernel_init) -> dict:
  """The `kernel` and `bias` `nn.Dense(features)` creates in `module`'s scope (same names, shapes,
  dtype and initialisers, hence the same initial values)."""
  return {"kernel": module.param("kernel", kernel_init, (in_features, features), jnp.float32),
          "bias": module.param("bias", nn.initializers.zeros_init(), (features,), jnp.float32)}


def dense(x: Array, params: dict, dtype, bias_add=add_bias) -> Array:
  """`nn.Dense(dtype=dtype)` applied with `params`: x and the parameters cast to `dtype`, x · kernel
  + bias, added by `bias_add` (by default `column_sums.add_bias`: its gradient one plain sum)."""
  x, kernel, bias = (a.astype(dtype) for a in (x, params["kernel"], params["bias"]))
  return bias_add(jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))), bias)


class Dense(nn.Module):
  """`nn.Dense(features, dtype=dtype, kernel_init=kernel_init)`: its parameters and values (`dense`),
  the bias gradient summed over x's rows as the policy in effect says (`Policy.row_sums`)."""
  features: int
  kernel_init: Any
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return dense(x, _dense_params(self, x.shape[-1], self.features, self.kernel_init), self.dtype,
                 bias_add=functools.partial(add_bias, sums=policy.current().row_sums))


class DenseParams(nn.Module):
  """The `kernel` and `bias` an `nn.Dense(features)` named like this module would create, returned unapplied."""
  features: int
  kernel_init: Any

  @nn.compact
  def __call__(self, in_features: int) -> dict:
    return _dense_params(self, in_features, self.features, self.kernel_init)


def fused_dense(x: Array, params: Sequence[dict], dtype) -> tuple[Array, ...]:
  """Several `nn.Dense` layers of the same input as one: their kernels and biases concatenated
  along the output axis, applied by one `dense` (one GEMM), the result split back.

  Each output column is the same dot product and bias add as in its own `nn.Dense`. The
  parameters are cast to `dtype` before the concatenation (the cast `nn.Dense` makes: the same
  values; a no-op where the step passes the half-precision copies, `training/weight_copies.py`).
  XLA places the concatenation itself: holding it in a kernel of its own (an optimization barrier)
  predicted a slower H100 step (BENCHMARKS.md, step cuts). The bias is added plainly: the gradient
  arrives in the attention's head layout, where XLA already sums it in two stages (tokens, then
  sentences); `column_sums`' row chunks would first transpose it back."""
  widths = [p["bias"].shape[0] for p in params]
  y = dense(x, _concatenated(params, dtype), dtype, bias_add=jnp.add)
  return tuple(jnp.split(y, list(itertools.accumulate(widths[:-1])), axis=-1))


def fused_projection(x: Array, params: Sequence[dict], dtype) -> tuple[Array, tuple[Array, ...]]:
  """`fused_dense`'s GEMM whole and before its biases: (x · kernels in `dtype`, the layers side by
  side on the last axis; each layer's bias as stored), for a kernel that casts and adds the biases
  itself (`kernels/dropout_attention.py`)."""
  kernel = _concatenated(params, dtype, ("kernel",))["kernel"]
  return (jax.lax.dot_general(x.astype(dtype), kernel, (((x.ndim - 1,), (0,)), ((), ()))),
          tuple(p["bias"] for p in params))


def _concatenated(params: Sequence[dict], dtype, names=("kernel", "bias")) -> dict:
  return {name: jnp.concatenate([p[name].astype(dtype) for p in params], axis=-1) for name in names}
