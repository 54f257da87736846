"""The embedding lookup of half-precision runs: gather float32 rows, then cast.

Flax's `nn.Embed` casts the whole table to the compute dtype before `take`, so the gradient's
scatter-add into the table runs in bfloat16/float16. On an H100 that scatter took 35 ms of a
55 ms BERT-base step at batch 50 (all 3,200 tokens add into row 0 of the token-type table),
0.07 ms in float32 (BENCHMARKS.md, GPU section); XLA:CPU upcasts it, so a CPU never shows it.
`Embed` gathers the float32 rows and casts the result: the same forward values (the cast
commutes with the gather) and a float32 scatter-add in the backward pass.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import Array


class Embed(nn.Embed):
  """`nn.Embed` (same parameter, same `attend`) whose lookup is `take(float32 table).astype(dtype)`."""

  def __call__(self, inputs: Array) -> Array:
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    return jnp.take(self.embedding, inputs, axis=0).astype(self.dtype or self.embedding.dtype)
