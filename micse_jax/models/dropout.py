"""Inverted dropout: flax's draw, a cheaper draw (16 random bits per decision), a cheaper generator.

Dropout needs one Bernoulli draw per activation; with several dropout sites per layer, two
views and the momentum encoder, a miCSE step draws ~45M of them (MiniLM-L6, 64 × 32 tokens),
and the counter-based PRNG (threefry) that produces the bits is a visible share of the step.
`flax.linen.Dropout` spends a 32-bit word per decision. With `random_bits=16` each 32-bit
word gives two decisions: unit i is dropped when its 16-bit half is below round(rate·2^16), so
the drop probability is round(rate·2^16)/2^16 (0.1 → 0.100006, 0.3 → 0.299988: within 2^-17
of `rate`); kept units are scaled by 1/(1 − rate), as in flax/HF. `random_bits=32` with the
threefry generator is exactly `flax.linen.Dropout`.

`rng_impl` (`RNG_IMPLS`) picks the generator of the words: "threefry" (JAX's default,
threefry2x32: about 20 rounds of integer work per word), or JAX's "rbg" / "unsafe_rbg" (XLA's
RngBitGenerator, Philox on GPU and CPU: a quarter of the integer work per word). The flax
dropout key (threefry, derived per step, site and view as always) seeds the site's RBG key, so
the train state's key and checkpoints are the same whatever the choice. Under `jax.vmap` over
keys (a population's members) XLA's RngBitGenerator draws every member's bits from the first
member's key; `_rbg_words` draws each member's words from its own key instead, so a member's
masks are its solo run's.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from micse_jax.models import row_block

RANDOM_BITS = (32, 16)
RNG_IMPLS = {"threefry": "threefry2x32", "rbg": "rbg", "unsafe_rbg": "unsafe_rbg"}  # name -> JAX's impl


def drop_threshold(rate: float, bits: int = 16) -> int:
  """`bits`-bit draws below this are dropped: P(drop) = threshold / 2^bits."""
  return min(int(round(rate * 2 ** bits)), 2 ** bits - 1)


def site_key(key: jax.Array, rng_impl: str) -> jax.Array:
  """The key a dropout site draws its words from: flax's threefry key itself ("threefry"), or
  a typed key of `rng_impl` whose data are four threefry words of it."""
  if rng_impl not in RNG_IMPLS:
    raise ValueError(f"dropout rng_impl must be one of {tuple(RNG_IMPLS)}, got {rng_impl!r}")
  if rng_impl == "threefry":
    return key
  return jax.random.wrap_key_data(jax.random.bits(key, (4,), jnp.uint32), impl=RNG_IMPLS[rng_impl])


@functools.lru_cache(maxsize=None)
def _rbg_words(shape: tuple[int, ...], impl: str):
  """uint32 words of `shape` from RBG key data (uint32[4]), drawn per key under `vmap`."""
  @jax.custom_batching.custom_vmap
  def draw(data):
    return jax.random.bits(jax.random.wrap_key_data(data, impl=impl), shape, jnp.uint32)

  @draw.def_vmap
  def _per_key(axis_size, in_batched, data):
    if not in_batched[0]:
      return draw(data), False
    return jnp.stack([draw(data[i]) for i in range(axis_size)]), True  # one draw per member's own key
  return draw


def random_words(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """uint32 random words of `shape` from a site key (`site_key`)."""
  if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.bits(key, shape, jnp.uint32)
  impl = jax.random.key_impl(key)
  return _rbg_words(tuple(shape), str(impl))(jax.random.key_data(key))


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
  words = random_words(key, (rows, (per_row + 1) // 2))
  halves = jnp.concatenate([words & 0xFFFF, words >> 16], axis=-1)[:, :per_row]
  return (halves >= drop_threshold(rate)).reshape(shape)


def keep_mask(key: jax.Array, shape: tuple[int, ...], rate: float, random_bits: int, rng_impl: str) -> jax.Array:
  """bool mask, True = keep, P(keep) = 1 − rate (to 2^-17 with 16 bits, 2^-33 with 32)."""
  key = site_key(key, rng_impl)
  if random_bits == 16:
    return keep_mask_16bit(key, shape, rate)
  if rng_impl == "threefry":  # flax.linen.Dropout's draw, bit for bit
    return jax.random.bernoulli(key, p=1.0 - rate, shape=shape)
  return random_words(key, shape) >= jnp.uint32(drop_threshold(rate, 32))


class Dropout(nn.Module):
  """`flax.linen.Dropout(rate)` (random_bits=32, rng_impl="threefry") or a cheaper variant."""
  rate: float
  random_bits: int = 32
  rng_impl: str = "threefry"

  def site_rng(self) -> jax.Array:
    """The key `__call__` would draw this site's mask from (its first `make_rng`): for a kernel
    that draws the same bits itself (`kernels/dropout_attention.py`)."""
    return self.make_rng("dropout")

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool, draw_shape: tuple[int, ...] | None = None) -> jax.Array:
    """x dropped; with `draw_shape`, x is the leading part (`x.shape` from index 0 on every axis)
    of an activation of that shape, and its mask is that part of the full shape's mask: the
    same bits as if the whole activation were dropped (the counter-based generators compute
    only the part kept). Inside a `row_block.Block` (a block of a batch's rows), x's rows are that
    block's, and the mask is the whole batch's at those rows."""
    if self.random_bits not in RANDOM_BITS:
      raise ValueError(f"dropout random_bits must be one of {RANDOM_BITS}, got {self.random_bits}")
    if deterministic or self.rate == 0.0:
      return x
    if self.rate >= 1.0:
      return jnp.zeros_like(x)
    shape, block = tuple(draw_shape or x.shape), row_block.current()
    if block is not None:  # a block of the batch's rows: the whole batch's mask at those rows
      shape = (block.whole_rows(shape[0]),) + shape[1:]
    keep = keep_mask(self.make_rng("dropout"), shape, self.rate, self.random_bits, self.rng_impl)
    if block is not None:
      keep = block.of_whole(keep)
    keep = keep[tuple(slice(0, n) for n in x.shape)]
    # No optimization barrier on the mask: XLA then draws a site's bits inside the kernel that
    # applies them (the residual add), overlapping the integer work with that kernel's memory
    # traffic, instead of drawing all sites' masks in one integer-bound kernel and reading them back
    # (the faster H100 step by the time model; BENCHMARKS.md, step cuts).
    return jax.lax.select(keep, x / (1.0 - self.rate), jnp.zeros_like(x))

  def leading(self, x: jax.Array, deterministic: bool, length: int) -> jax.Array:
    """x `[B, T', ...]` dropped as the first T' of `length` positions (axis 1) of an activation whose
    other axes are x's: its mask is that part of the whole activation's (`__call__`'s `draw_shape`)."""
    return self(x, deterministic=deterministic, draw_shape=x.shape[:1] + (length,) + x.shape[2:])
