"""Inverted dropout with a cheaper draw: 16 random bits per keep/drop decision.

Dropout needs one Bernoulli draw per activation; with several dropout sites per layer, two
views and the momentum encoder, a miCSE step draws ~45M of them (MiniLM-L6, 64 × 32 tokens),
and on CPU the counter-based PRNG (threefry) that produces the bits is a visible share of the
step. `flax.linen.Dropout` spends a 32-bit word per decision. With `random_bits=16` each 32-bit
word gives two decisions: unit i is dropped when its 16-bit half is below round(rate·2^16), so
the drop probability is round(rate·2^16)/2^16 (0.1 → 0.100006, 0.3 → 0.299988: within 2^-17
of `rate`); kept units are scaled by 1/(1 − rate), as in flax/HF. `random_bits=32` is exactly
`flax.linen.Dropout`.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

RANDOM_BITS = (32, 16)


def drop_threshold(rate: float) -> int:
  """16-bit draws below this are dropped: P(drop) = threshold / 2^16."""
  return int(round(rate * 65536))


def keep_mask_16bit(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
  """bool mask, True = keep; two decisions per 32-bit random word.

  Words are drawn per row of the leading (batch) axis, the low halves deciding a row's first
  units and the high halves the rest, so a row's mask does not depend on the number of rows
  (a padded batch) and the draw splits over a batch-sharded mesh without moving anything.
  """
  rows = shape[0] if len(shape) > 1 else 1
  per_row = 1
  for d in shape[1:] if len(shape) > 1 else shape:
    per_row *= d
  words = jax.random.bits(key, (rows, (per_row + 1) // 2), jnp.uint32)
  halves = jnp.concatenate([words & 0xFFFF, words >> 16], axis=-1)[:, :per_row]
  return (halves >= drop_threshold(rate)).reshape(shape)


class Dropout(nn.Module):
  """`flax.linen.Dropout(rate)` (random_bits=32) or its 16-bit-draw variant (random_bits=16)."""
  rate: float
  random_bits: int = 32

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    if self.random_bits not in RANDOM_BITS:
      raise ValueError(f"dropout random_bits must be one of {RANDOM_BITS}, got {self.random_bits}")
    if deterministic or self.rate == 0.0:
      return x
    if self.rate >= 1.0:
      return jnp.zeros_like(x)
    key, keep_prob = self.make_rng("dropout"), 1.0 - self.rate
    if self.random_bits == 32:  # flax.linen.Dropout's draw, bit for bit
      keep = jax.random.bernoulli(key, p=keep_prob, shape=x.shape)
    else:
      keep = keep_mask_16bit(key, x.shape, self.rate)
    # The mask as its own value (its bits are a function of the key alone): XLA then draws the masks
    # of several sites in one kernel and applies each inside its consumer's fusion (on an H100 the
    # momentum encoder's attention dropout joins the softmax: 11 kernels and 0.19 GiB less per step,
    # BENCHMARKS.md, kernel diet) instead of redrawing the bits inside a kernel of their own.
    keep = jax.lax.optimization_barrier(keep)
    return jax.lax.select(keep, x / keep_prob, jnp.zeros_like(x))
