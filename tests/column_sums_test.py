"""`models/column_sums.py`: bias and LayerNorm-parameter gradients summed in two stages on CUDA.

The chunk count against hand-worked cases, both stages' sums against NumPy float64, the bias
gradient against autodiff of a plain add, and which sum each platform lowers."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.models import column_sums as cs


@pytest.mark.parametrize("rows, columns, expected", [
    (3200, 768, 50),    # R · 768 >= 32768 needs R >= 43; 43..49 do not divide 3200
    (3200, 3072, 16),   # R >= 11; 11..15 do not divide 3200
    (3200, 65536, 2),   # wide enough already: the smallest split
    (97, 768, 1),       # prime: no chunks
    (64, 768, 1),       # chunks of >= 16 rows allow R <= 4: 4 · 768 < 32768
])
def test_chunk_count(rows, columns, expected):
  assert cs.chunks(rows, columns) == expected


def _values(shape, dtype=jnp.float32, seed=0):
  return (jax.random.normal(jax.random.PRNGKey(seed), shape) * 3.0 + 1.0).astype(dtype)


@pytest.mark.parametrize("shape", [(100, 32, 768), (50, 64, 96), (7, 5)])
def test_both_stages_sum_every_row(shape):
  a, b = _values(shape), _values(shape, seed=1)
  want = [np.asarray(v, np.float64).reshape(-1, shape[-1]).sum(0) for v in (a, b)]
  for got in (cs._two_stage(a, b), cs._plain(a, b), cs.column_sums(a, b)):
    for g, w in zip(got, want):
      assert g.shape == (shape[-1],) and g.dtype == jnp.float32
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-3)


def test_half_precision_values_are_summed_in_float32_and_returned_as_their_dtype():
  x = _values((3200, 768), jnp.bfloat16)
  assert cs.chunks(3200, 768) > 1
  (got,) = cs._two_stage(x)
  assert got.dtype == jnp.bfloat16
  want = np.asarray(x, np.float64).sum(0)
  # one bfloat16 rounding of the float32 sum (8 bits: 2^-8 relative)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -8, atol=0.5)


def test_bias_gradient_is_the_column_sum_of_the_output_gradient():
  y, bias = _values((4, 6, 8)), _values((8,), seed=2)
  weights = _values((4, 6, 8), seed=3)
  ours = jax.grad(lambda y, b: jnp.sum(weights * cs.add_bias(y, b) ** 2), argnums=(0, 1))(y, bias)
  plain = jax.grad(lambda y, b: jnp.sum(weights * (y + b) ** 2), argnums=(0, 1))(y, bias)
  np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
  np.testing.assert_allclose(ours[1], plain[1], rtol=1e-5, atol=1e-4)
  g = 2 * np.asarray(weights, np.float64) * (np.asarray(y, np.float64) + np.asarray(bias, np.float64))
  np.testing.assert_allclose(ours[1], g.reshape(-1, 8).sum(0), rtol=1e-5, atol=1e-4)


def _lowered(platform: str, shape) -> str:
  x = _values(shape)
  return jax.jit(cs.column_sums).trace(x).lower(lowering_platforms=(platform,)).as_text()


def test_cuda_lowers_two_stages_and_cpu_one_sum():
  reduces = lambda text: len(re.findall(r"stablehlo\.reduce\(", text))
  cuda, cpu = _lowered("cuda", (3200, 768)), _lowered("cpu", (3200, 768))
  assert "tensor<50x64x768xf32>" in cuda and "optimization_barrier" in cuda and reduces(cuda) == 2
  assert "64x768" not in cpu and "optimization_barrier" not in cpu and reduces(cpu) == 1
  # too few rows to chunk: one sum on CUDA too
  assert reduces(_lowered("cuda", (64, 768))) == 1
