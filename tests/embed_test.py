"""`models/embed.py`: the small-table lookup whose gradient is summed per row on CUDA, and the lookup
of a table split by features over several devices.

Values against `take`, the table gradient against NumPy's `np.add.at` (the scatter-add they
replace), which backward each target's policy lowers, and when a table is looked up split."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.kernels.choice import Target
from micse_jax.models import embed
from micse_jax.models.policy import Policy


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
    with Policy(target=Target(platform)).applied():  # as a model compiled for `platform` applies it
      grad = jax.jit(jax.grad(lambda p: jnp.sum(module.apply(p, ids) ** 2)))
      return grad.trace(params).lower(lowering_platforms=(platform,)).as_text()

  assert "scatter" not in lowered(small, "cuda")
  assert "scatter" in lowered(small, "cpu")
  assert "scatter" in lowered(large, "cuda")


def test_a_small_tables_gradient_is_summed_in_chunks_of_each_devices_rows():
  """The token types' gradient under data parallelism: 512 × 32 ids over 4 devices are summed in
  4 · 64 chunks of 64 rows (each device's 4096 rows cut as one device's, `column_sums`), on one
  device in 64 chunks of 256."""
  ids = jnp.zeros((512, 32), jnp.int32)

  def lowered(row_split):
    module = embed.Embed(num_embeddings=2, features=768)
    params = module.init(jax.random.PRNGKey(0), ids[:1])
    mesh = SimpleNamespace(size=row_split) if row_split > 1 else None  # what Policy.row_split reads
    with Policy(target=Target("cuda", (9, 0), devices=row_split, mesh=mesh)).applied():
      grad = jax.jit(jax.grad(lambda p: jnp.sum(module.apply(p, ids))))
      return grad.trace(params).lower(lowering_platforms=("cuda",)).as_text()

  split, whole = lowered(4), lowered(1)
  assert "tensor<256x64x768xf32>" in split and "tensor<256x64x768xf32>" not in whole
  assert "tensor<64x256x768xf32>" in whole


@pytest.mark.parametrize("rows, features, ids_shape, devices, itemsize, expected", [
    (30522, 768, (1024, 32), 8, 2, True),   # BERT's vocabulary, 512 sentences' two views: 94 MB vs 8 kB ids
    (512, 768, (1024, 32), 8, 2, False),    # the positions: 512 * 4 bytes a feature < 4096 ids * 2
    (2048, 768, (1024, 32), 8, 2, False),   # 8192 bytes of table per feature = 8192 of rows: not fewer
    (2049, 768, (1024, 32), 8, 2, True),
    (30522, 768, (1024, 32), 1, 2, False),  # one device: nothing to split
    (30522, 770, (1024, 32), 8, 2, False),  # features the devices do not divide
    (30522, 768, (1020, 32), 8, 2, False),  # nor the batch
    (30522, 768, (), 8, 2, False),          # a scalar id
])
def test_when_a_table_is_looked_up_split(rows, features, ids_shape, devices, itemsize, expected):
  assert embed.splits_lookup(rows, features, ids_shape, devices, itemsize) is expected


def test_split_lookup_on_four_devices_equals_take_and_never_gathers_the_table():
  from tests.helpers import run_device_worker
  out = run_device_worker("tests.embed_devices_worker", devices=4)
  assert out["values_equal"] and out["output_spec"] == "P('data',)"
  assert out["grad_error"] <= 1e-6 * out["grad_scale"]
  assert out["grad_spec"] == "P(None, 'data')"  # the gradient lands where the sharded state holds the table
  assert not out["table_gathered_in_grad"]
  assert out["grad_collectives"] == ["all-gather", "all-to-all"]  # the ids gathered, the rows exchanged
  assert out["module_collectives"] == ["all-gather", "all-to-all"]
  assert out["small_table_collectives"] == ["all-gather"]  # a small table: gathered whole, no exchange
  assert out["gathered_specs"] == {"dense": "P()", "word_embeddings": "P(None, 'data')"}
