"""LayerNorm with a hand-written VJP on CUDA: BERT's LayerNorm in fewer GPU kernels.

  y = x̂ · γ + β,   x̂ = (x − μ) · rstd,   μ = mean(x),   rstd = 1 / sqrt(mean((x − μ)²) + ε)

over the last axis, in float32 whatever the input's dtype, the result cast to `dtype`: the
values of `flax.linen.LayerNorm` (same parameters `scale` = γ and `bias` = β, same initial
values), except that the variance is two-pass, mean((x − μ)²), as PyTorch's `LayerNorm`
computes it, instead of flax's mean(x²) − μ² (the two differ by float32 rounding).

Why not flax's: on an H100 its forward is three kernels per LayerNorm (statistics, `rsqrt`,
normalise) and autodiff adds about four; BERT-base has 25 LayerNorms per encoder pass and a
miCSE step runs three passes. Two-pass statistics form the reduce-then-broadcast shape XLA
compiles into one Triton norm fusion, so the forward is one kernel. The backward keeps only x
from the forward and recomputes the statistics. With g = dy · γ:

  dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)),   mean(g · x̂) = rstd · (mean(g · x) − μ · mean(g))
  dγ = Σ_rows dy · x̂,   dβ = Σ_rows dy

Its row sums (x, x², g, g · x: one pass, none depending on another; the variance from them is
max(mean(x²) − μ², 0), the forward's up to rounding) are one variadic reduction, so they are one
kernel in a sharded program too (as two reductions, XLA split them into two passes there); its
column sums (dγ, dβ) one variadic sum in two stages (`models/column_sums.py`, whose first stage
fuses into the kernel that computes dx); dx's elementwise part fuses into the kernel of
whatever consumes it (dropout's backward). Written with two-pass statistics and plain
reductions instead, XLA's Triton norm rewriter takes the backward apart into more kernels and
float32 temporaries (`BENCHMARKS.md`, kernel diet).

Only where it pays: the module (`LayerNorm`) takes the hand-written VJP where its model's policy
targets CUDA (`kernels/choice.own_gradients` of `Policy.target`, so a program compiled on this CPU
for a GPU that is not here gets it too) and lets JAX differentiate the same forward everywhere else:
XLA:CPU runs the variadic reductions as scalar loops (the LayerNorm backward 1.9x and the whole CPU
step 1.7-2x slower) and, under `model.remat=full`, keeps more than it saves.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from micse_jax.kernels.choice import OWN_GRADIENT_SCOPE
from micse_jax.models import policy
from micse_jax.models.column_sums import RowSums, column_sums, variadic_sum

Array = jax.Array


def _normalise(x: Array, epsilon: float) -> tuple[Array, Array]:
  """x̂ = (x − μ) · rstd over the last axis (float32) and rstd (keepdims); two-pass variance."""
  x = x.astype(jnp.float32)
  centred = x - jnp.mean(x, axis=-1, keepdims=True)
  rstd = jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + epsilon)
  return centred * rstd, rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def layer_norm(x: Array, scale: Array, bias: Array, epsilon: float, dtype: Any, sums: RowSums = RowSums()) -> Array:
  """x̂ · γ + β over the last axis, computed in float32, returned as `dtype`; `sums`: how dγ and dβ
  are summed over x's rows (`column_sums`)."""
  return _layer_norm_forward(x, scale, bias, epsilon, dtype, sums)[0]


def _layer_norm_forward(x, scale, bias, epsilon, dtype, sums):
  del sums
  return (_normalise(x, epsilon)[0] * scale + bias).astype(dtype), (x, scale)


def _input_gradient(x: Array, scale: Array, dy: Array, epsilon: float) -> tuple[Array, Array]:
  """dx and x̂ (float32) of the module docstring's equations, μ and rstd recomputed from x."""
  x, dy, width = x.astype(jnp.float32), dy.astype(jnp.float32), x.shape[-1]
  g = dy * scale
  sums = variadic_sum((x, jnp.square(x), g, g * x), (-1,))  # one reduction: one pass over x and dy
  mean, mean_of_squares, g_mean, gx_mean = (s[..., None] / width for s in sums)
  rstd = jax.lax.rsqrt(jnp.maximum(mean_of_squares - jnp.square(mean), 0.0) + epsilon)
  normalised = (x - mean) * rstd
  return rstd * (g - g_mean - normalised * (gx_mean - mean * g_mean) * rstd), normalised


def _layer_norm_backward(epsilon, dtype, sums, residuals, dy):
  """dx, dγ, dβ of the module docstring's equations."""
  del dtype
  x, scale = residuals
  with jax.named_scope(OWN_GRADIENT_SCOPE):  # a CUDA gradient of ours (`kernels/choice.OWN_MARKS`)
    dx, normalised = _input_gradient(x, scale, dy, epsilon)
    dy = dy.astype(jnp.float32)
    dscale, dbias = column_sums(dy * normalised, dy, sums=sums)
  return dx.astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(scale.dtype)


layer_norm.defvjp(_layer_norm_forward, _layer_norm_backward)


class LayerNorm(nn.Module):
  """`flax.linen.LayerNorm(epsilon, dtype)`'s parameters and values (two-pass variance): the hand-written
  VJP (`layer_norm`) where the policy of the model applying it chooses the CUDA gradients
  (`Policy.own_gradients`), JAX's autodiff of the same forward elsewhere (module docstring)."""
  epsilon: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = (x.shape[-1],)
    scale = self.param("scale", nn.initializers.ones_init(), features, jnp.float32)
    bias = self.param("bias", nn.initializers.zeros_init(), features, jnp.float32)
    applied = policy.current()
    if applied.own_gradients:
      return layer_norm(x, scale, bias, self.epsilon, self.dtype, applied.row_sums)
    return _autodiff_layer_norm(x, scale, bias, self.epsilon, self.dtype)


def _autodiff_layer_norm(x: Array, scale: Array, bias: Array, epsilon: float, dtype: Any) -> Array:
  """`layer_norm`'s forward, differentiated by JAX."""
  return (_normalise(x, epsilon)[0] * scale + bias).astype(dtype)
