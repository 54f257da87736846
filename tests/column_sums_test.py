"""`models/column_sums.py`: bias and LayerNorm-parameter gradients summed in two stages on CUDA.

The chunk count against hand-worked cases, both stages' sums against NumPy float64, the bias
gradient against autodiff of a plain add, and which sum each target's policy lowers."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.kernels.choice import Target, own_gradients
from micse_jax.models import column_sums as cs
from micse_jax.models.policy import Policy


@pytest.mark.parametrize("rows, columns, expected", [
    (3200, 768, 50),    # R · 768 >= 32768 needs R >= 43; 43..49 do not divide 3200
    (3200, 3072, 16),   # R >= 11; 11..15 do not divide 3200
    (3200, 65536, 2),   # wide enough already: the smallest split
    (97, 768, 1),       # prime: no chunks
    (64, 768, 1),       # chunks of >= 16 rows allow R <= 4: 4 · 768 < 32768
])
def test_chunk_count(rows, columns, expected):
  assert cs.chunks(rows, columns) == expected


@pytest.mark.parametrize("rows, columns, devices, expected", [
    (8 * 4096, 768, 8, 8 * 64),   # a device's 4096 rows: R_d >= 43; 43..63 do not divide 4096
    (8 * 4096, 3072, 8, 8 * 16),  # R_d >= 11: 16
    (2 * 3200, 768, 2, 2 * 50),   # each device as one device at 3200 rows
    (4 * 64, 768, 4, 1),          # 64 rows a device: too few to chunk
    (3200, 768, 3, 50),           # rows 3 devices do not divide: chunked as one device's
])
def test_chunks_are_fitted_to_each_devices_rows(rows, columns, devices, expected):
  assert cs.chunks(rows, columns, devices) == expected
  if expected > 1 and rows % devices == 0:  # whole chunks on every device, each as one device would cut
    assert expected % devices == 0 and expected // devices == cs.chunks(rows // devices, columns)


def test_on_four_devices_each_sums_its_own_rows_into_as_many_chunks_as_one_device():
  """The two stages of a batch split over 4 devices (the compiled program's per-device shapes): fitted
  to a device's 4096 rows, each device's first stage writes 64 chunks of 768 sums; fitted to the
  whole batch's rows (16384: 64 chunks), each device would hold 16, a narrow reduction. Either way
  the only collective is the final all-reduce and the sums equal NumPy's."""
  from tests.helpers import run_device_worker
  out = run_device_worker("tests.column_sums_devices_worker", devices=4)
  assert out["per_device"]["partial_rows"] == [64] and out["whole_batch"]["partial_rows"] == [16]
  for fit in out.values():
    assert fit["collectives"] == ["all-reduce"]
    assert fit["max_error"] <= 1e-6 * fit["max_sum"] * 64  # float32 sums of 64 and 256 terms


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


@pytest.mark.parametrize("target, expected", [
    (Target("cuda", (9, 0)), True), (Target("cuda", (7, 0)), True), (Target("cpu"), False),
    (Target("rocm"), False), (Target("tpu"), False), (Target("cpu", interpret=True), False),
    (Target("cuda", (9, 0), own_kernels=False), False)])  # the program built again without our kernels
def test_the_cuda_gradients_are_chosen_from_the_target(target, expected):
  assert own_gradients(target) is expected and Policy(target=target).row_sums.two_stage is expected


def _lowered(platform: str, shape) -> str:
  """`column_sums` as the policy of a model compiled for `platform` sums, lowered for it."""
  x = _values(shape)
  sums = Policy(target=Target(platform, (9, 0) if platform == "cuda" else None)).row_sums
  fn = lambda v: cs.column_sums(v, sums=sums)
  return jax.jit(fn).trace(x).lower(lowering_platforms=(platform,)).as_text()


def test_cuda_lowers_two_stages_and_cpu_one_sum():
  reduces = lambda text: len(re.findall(r"stablehlo\.reduce\(", text))
  cuda, cpu = _lowered("cuda", (3200, 768)), _lowered("cpu", (3200, 768))
  assert "tensor<50x64x768xf32>" in cuda and "optimization_barrier" in cuda and reduces(cuda) == 2
  assert "64x768" not in cpu and "optimization_barrier" not in cpu and reduces(cpu) == 1
  # too few rows to chunk: one sum on CUDA too
  assert reduces(_lowered("cuda", (64, 768))) == 1


def _bert_gradient_lowered_for_cuda(row_split: int) -> str:
  """A one-layer BERT-base-wide model's parameter gradient at 512 sentences of 32 tokens, lowered for
  CUDA with its rows split over `row_split` devices (a V100-like target: the explicit attention path)."""
  from types import SimpleNamespace

  from micse_jax.models.bert import BertConfig, BertModel
  config = BertConfig(vocab_size=100, hidden_size=768, num_hidden_layers=1, num_attention_heads=12,
                      intermediate_size=3072)
  mesh = SimpleNamespace(size=row_split) if row_split > 1 else None  # what Policy.row_split reads
  target = Target(platform="cuda", compute_capability=(7, 0), devices=row_split, mesh=mesh)
  model = BertModel(config, dtype=jnp.bfloat16, policy=Policy(target=target))
  ids = jnp.zeros((512, 32), jnp.int32)
  params = jax.eval_shape(lambda: BertModel(config).init(jax.random.PRNGKey(0), ids[:1], ids[:1])["params"])
  loss = lambda p: jnp.sum(model.apply({"params": p}, ids, jnp.ones_like(ids)).last_hidden_state.astype(jnp.float32))
  return jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()


def test_bert_fits_its_bias_and_layer_norm_chunks_to_each_devices_rows():
  """16384 rows over 4 devices: the LayerNorms' dγ, dβ in 4 · 64 chunks of 64 rows and the FFN bias
  in 4 · 16 chunks of 256 (each device's 4096 rows cut as one device's); on one device the whole
  batch's 16384 rows in 64 chunks of 256 and 16 of 1024."""
  split, whole = _bert_gradient_lowered_for_cuda(4), _bert_gradient_lowered_for_cuda(1)
  assert "tensor<256x64x768xf32>" in split and "tensor<64x256x3072xf32>" in split
  assert "tensor<64x256x768xf32>" in whole and "tensor<16x1024x3072xf32>" in whole
  assert "tensor<256x64x768xf32>" not in whole
