"""`models/embed.py`: the small-table lookup whose gradient is summed per row on CUDA.

Values against `take`, the table gradient against NumPy's `np.add.at` (the scatter-add it
replaces), and which backward each platform lowers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.models import embed


def _case(rows=3, shape=(6, 9), features=5):
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, rows, size=shape), jnp.int32)
  table = jnp.asarray(rng.normal(size=(rows, features)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=shape + (features,)), jnp.float32)
  return ids, table, weights


@pytest.mark.parametrize("lookup", ["summed", "platform"])
def test_values_and_table_gradient_equal_take_and_its_scatter_add(lookup):
  ids, table, weights = _case()
  fn = (lambda t, i: embed._summed_lookup(t, i, t.shape[0])) if lookup == "summed" else embed.small_table_lookup
  np.testing.assert_array_equal(fn(table, ids), np.asarray(table)[np.asarray(ids)])
  grad = jax.grad(lambda t: jnp.sum(weights * fn(t, ids) ** 2))(table)
  expected = np.zeros(table.shape)
  np.add.at(expected, np.asarray(ids), 2 * np.asarray(weights, np.float64) * np.asarray(table)[np.asarray(ids)])
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)


def test_module_uses_the_summed_gradient_for_small_tables_only():
  ids, _, _ = _case(rows=2)
  small = embed.Embed(num_embeddings=2, features=5)
  large = embed.Embed(num_embeddings=embed.SMALL_TABLE + 1, features=5)

  def lowered(module, platform):
    params = module.init(jax.random.PRNGKey(0), ids)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(module.apply(p, ids) ** 2)))
    return grad.trace(params).lower(lowering_platforms=(platform,)).as_text()

  assert "scatter" not in lowered(small, "cuda")
  assert "scatter" in lowered(small, "cpu")
  assert "scatter" in lowered(large, "cuda")
