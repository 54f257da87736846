"""Dropout: 32 bits == flax.linen.Dropout exactly; 16 bits drops at rate round(r·2^16)/2^16."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.models.dropout import Dropout, drop_threshold


def _apply(module, x, seed=0):
  return module.apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(seed)})


def test_32_bits_is_flax_dropout_bit_for_bit():
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 7, 33))
  np.testing.assert_array_equal(_apply(Dropout(0.1, 32), x), _apply(nn.Dropout(0.1), x))


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_16_bits_drop_rate_and_scaling(rate):
  x = jnp.ones((1000, 1001))  # odd size: the last random word is half used
  y = np.asarray(_apply(Dropout(rate, 16), x))
  assert set(np.unique(y)) == {0.0, np.float32(1 / (1 - rate))}  # inverted dropout scaling
  exact = drop_threshold(rate) / 65536
  assert abs(exact - rate) <= 2 ** -17
  n = y.size  # binomial: 5 standard deviations
  assert abs(np.mean(y == 0) - exact) < 5 * np.sqrt(exact * (1 - exact) / n)
  assert not np.array_equal(y, np.asarray(_apply(Dropout(rate, 16), x, seed=1)))


def test_16_bits_halves_are_independent_decisions():
  """The two units fed by one random word are not correlated (2x2 contingency near product)."""
  y = np.asarray(_apply(Dropout(0.5, 16), jnp.ones((200_000,)))) == 0
  first, second = y[:100_000], y[100_000:]  # unit i uses the low half of word i, unit i+n/2 its high half
  both = np.mean(first & second)
  assert abs(both - 0.25) < 5 * np.sqrt(0.25 * 0.75 / 100_000)


def test_deterministic_and_bad_bits():
  x = jnp.arange(6.0)
  np.testing.assert_array_equal(Dropout(0.5, 16).apply({}, x, deterministic=True), x)
  with pytest.raises(ValueError, match="random_bits"):
    _apply(Dropout(0.1, 8), x)


def test_16_bits_rows_do_not_depend_on_the_number_of_rows():
  """A padded batch (more rows) keeps the masks of the real rows: words are drawn per row."""
  from micse_jax.models.dropout import keep_mask_16bit
  key = jax.random.PRNGKey(3)
  small, padded = keep_mask_16bit(key, (3, 7, 5), 0.3), keep_mask_16bit(key, (8, 7, 5), 0.3)
  np.testing.assert_array_equal(padded[:3], small)
  assert not np.array_equal(padded[3], padded[4])
