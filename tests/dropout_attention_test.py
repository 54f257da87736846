"""The dropout-attention kernels (`models/dropout_attention.py`), run here in Pallas' interpreter:
their dropout bits against JAX's own generator, their context against a float64 NumPy attention
on the same mask and against `reference` (the explicit path's arithmetic), their gradient against
JAX's autodiff of `reference`, per population member under `vmap`; the model wiring against the
explicit path; the time model's account of the kernels against hand-computed work."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.aot import kernel_cost
from micse_jax.models import dropout_attention as da
from micse_jax.models.bert import BertModel
from micse_jax.models.bert_config import BertConfig

B, T, HEADS, D = 3, 32, 2, 64


def _inputs(seed=0, batch=B, heads=HEADS):
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  projection = (2 * jax.random.normal(keys[0], (batch, T, 3 * heads * D))).astype(jnp.bfloat16)
  biases = tuple(jax.random.normal(k, (heads * D,)) for k in jax.random.split(keys[1], 3))
  lengths = jnp.array([T, 19, 1, 7, 32][:batch])
  key_mask = jnp.arange(T)[None, :] < lengths[:, None]
  words = jax.random.key_data(jax.random.PRNGKey(seed + 100))
  return projection, biases, key_mask, words


def test_threefry_bits_are_jax_random_bits_at_each_index():
  words = jax.random.key_data(jax.random.PRNGKey(5))
  shape = (4, 3, 32, 32)
  expected = jax.random.bits(jax.random.wrap_key_data(words), shape, jnp.uint32)
  index = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)
  np.testing.assert_array_equal(da.threefry_bits(words[0], words[1], index), expected)


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.05])
def test_keep_below_reproduces_bernoulli(rate):
  words = jax.random.key_data(jax.random.PRNGKey(11))
  shape = (8, 12, 32, 32)
  bits = jax.random.bits(jax.random.wrap_key_data(words), shape, jnp.uint32)
  keep = jax.random.bernoulli(jax.random.wrap_key_data(words), 1.0 - rate, shape)
  np.testing.assert_array_equal((bits >> 9) < da.keep_below(rate), keep)
  assert abs(float(keep.mean()) - (1 - rate)) < 0.01


def _numpy_attention(projection, biases, key_mask, keep, rate):
  """softmax(QKᵀ/√d + mask) dropped by `keep`, times V, in float64 (no intermediate rounding)."""
  qkv = np.asarray(projection, np.float64) + np.concatenate(
      [np.asarray(b.astype(jnp.bfloat16), np.float64) for b in biases])
  batch, length, width = qkv.shape
  q, k, v = (t.reshape(batch, length, HEADS, D).transpose(0, 2, 1, 3) for t in np.split(qkv, 3, axis=-1))
  scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D)
  scores = np.where(np.asarray(key_mask)[:, None, None, :], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  probs = np.where(np.asarray(keep), probs / (1 - rate), 0.0)
  return (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, HEADS * D)


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_reference_is_attention_with_bernoulli_dropout(rate):
  projection, biases, key_mask, words = _inputs()
  keep = jax.random.bernoulli(jax.random.wrap_key_data(words), 1 - rate, (B, HEADS, T, T))
  ctx = da.reference(projection, biases, key_mask, words, rate, HEADS)
  expected = _numpy_attention(projection, biases, key_mask, keep, rate)
  error = np.asarray(ctx, np.float64) - expected
  # bfloat16 scores (a unit is 1/16 at |s| ~ 4) move a probability by a few percent at most
  assert np.linalg.norm(error) / np.linalg.norm(expected) < 0.01
  assert np.abs(error).max() < 0.2


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_forward_kernel_is_reference_bit_for_bit(rate):
  projection, biases, key_mask, words = _inputs(1)
  ctx, keep = da._pallas(projection, biases, key_mask, words, rate, HEADS, save_keep=True, interpret=True)
  want_ctx = da.reference(projection, biases, key_mask, words, rate, HEADS)
  want_keep = jax.random.bernoulli(jax.random.wrap_key_data(words), 1 - rate, (B, HEADS, T, T))
  np.testing.assert_array_equal(keep, want_keep.astype(jnp.int8))
  np.testing.assert_array_equal(np.asarray(ctx, np.float32), np.asarray(want_ctx, np.float32))


def test_backward_kernel_is_autodiff_of_reference():
  projection, biases, key_mask, words = _inputs(2)
  rate = 0.1
  cotangent = jax.random.normal(jax.random.PRNGKey(3), (B, T, HEADS * D)).astype(jnp.bfloat16)
  _, keep = da._pallas(projection, biases, key_mask, words, rate, HEADS, save_keep=True, interpret=True)
  got_projection, got_biases = da._pallas_backward(projection, biases, key_mask, keep, cotangent, rate, HEADS,
                                                   interpret=True)
  want_projection, want_biases = jax.vjp(
      lambda p, b: da.reference(p, b, key_mask, words, rate, HEADS), projection, biases)[1](cotangent)
  got, want = np.asarray(got_projection, np.float32), np.asarray(want_projection, np.float32)
  # the same roundings; float32 sums in another order move a few values by a bfloat16 unit
  np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3)
  assert np.mean(got != want) < 0.01
  # the bias gradient: the projection gradient's column sums, taken in float32 (rounded to
  # bfloat16, the gradient of the cast bias); autodiff of `reference` sums in bfloat16
  column_sums = np.split(np.asarray(got_projection, np.float64).sum(axis=(0, 1)), 3)
  for g, w, exact in zip(got_biases, want_biases, column_sums):
    assert g.dtype == w.dtype == jnp.float32
    np.testing.assert_allclose(g, exact, rtol=2 ** -8, atol=1e-6)
    np.testing.assert_allclose(w, exact, rtol=0.05, atol=0.2)


def test_each_population_member_draws_its_own_masks_under_vmap():
  members = 3
  projection = jnp.stack([_inputs(s)[0] for s in range(members)])
  _, biases, key_mask, _ = _inputs()
  words = jnp.stack([jax.random.key_data(jax.random.PRNGKey(s)) for s in range(members)])
  got = jax.vmap(lambda p, w: da._pallas(p, biases, key_mask, w, 0.1, HEADS, interpret=True))(projection, words)
  for m in range(members):
    want = da.reference(projection[m], biases, key_mask, words[m], 0.1, HEADS)
    np.testing.assert_array_equal(np.asarray(got[m], np.float32), np.asarray(want, np.float32))
  assert not np.array_equal(np.asarray(got[0]), np.asarray(got[1]))


@pytest.mark.parametrize("length,head_dim,dtype,bits,impl,takes", [
    (32, 64, jnp.bfloat16, 32, "threefry", True), (128, 32, jnp.float16, 32, "threefry", True),
    (32, 64, jnp.float32, 32, "threefry", False), (48, 64, jnp.bfloat16, 32, "threefry", False),
    (256, 64, jnp.bfloat16, 32, "threefry", False), (32, 48, jnp.bfloat16, 32, "threefry", False),
    (32, 64, jnp.bfloat16, 16, "threefry", False), (32, 64, jnp.bfloat16, 32, "rbg", False)])
def test_kernel_takes_only_what_it_reproduces(length, head_dim, dtype, bits, impl, takes):
  assert da.kernel_takes(length, head_dim, dtype, bits, impl) is takes


def _tiny(**kwargs):
  config = BertConfig(vocab_size=50, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=256, attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.1)
  return BertModel(config, dtype=jnp.bfloat16, **kwargs)


@pytest.mark.parametrize("cls_only", [False, True])
def test_model_with_the_kernels_is_the_explicit_model(cls_only):
  """On this CPU `dropout_attention` is `reference`, differentiated by JAX: the model's values and
  every parameter gradient equal the explicit path's, so the wiring that the kernels share (the
  site's dropout key, the projection and its biases, the [CLS]-only last layer) is the explicit
  path's; the kernels equal `reference` (the tests above)."""
  ids = jax.random.randint(jax.random.PRNGKey(0), (4, T), 1, 50)
  mask = (jnp.arange(T)[None] < jnp.array([T, 10, 5, 17])[:, None]).astype(jnp.int32)
  params = _tiny().init(jax.random.PRNGKey(1), ids, mask)["params"]

  def loss(p, kernel):
    out = _tiny(cls_only=cls_only, dropout_kernel=kernel).apply(
        {"params": p}, ids, mask, deterministic=False, rngs={"dropout": jax.random.PRNGKey(3)})
    return jnp.sum(out.last_hidden_state.astype(jnp.float32) ** 2), out.last_hidden_state

  (value, hidden), grads = jax.value_and_grad(loss, has_aux=True)(params, True)
  (want_value, want_hidden), want_grads = jax.value_and_grad(loss, has_aux=True)(params, False)
  np.testing.assert_array_equal(np.asarray(hidden, np.float32), np.asarray(want_hidden, np.float32))
  assert value == want_value
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_array_equal(got, want)


def test_model_takes_the_kernels_on_unsown_dropout_layers_only():
  ids = jnp.ones((2, T), jnp.int32)
  params = _tiny().init(jax.random.PRNGKey(1), ids, ids)["params"]

  def calls(deterministic=False, **kwargs):
    apply = lambda: _tiny(**kwargs).apply({"params": params}, ids, ids, deterministic=deterministic,
                                          rngs={"dropout": jax.random.PRNGKey(2)}, mutable=["intermediates"])
    return str(jax.make_jaxpr(apply)()).count(f"{da.KERNEL_NAME}_h2")

  both, one = calls(dropout_kernel=True), calls(dropout_kernel=True, sow_attention_layers=(1,))
  assert one > 0 and both == 2 * one  # a sown layer keeps the explicit path (AMI reads its probabilities)
  assert calls(dropout_kernel=True, deterministic=True) == 0  # no dropout: cuDNN / XLA's attention
  assert calls(dropout_kernel=False) == 0


def _triton_call(name: str, output: str, operands: str, params: str) -> str:
  return (f"HloModule jit_step\n\nENTRY %main ({params}) -> f32[] {{\n"
          + "".join(f"  %{p.split(':')[0]} = {p.split(': ')[1]} parameter({i})\n" for i, p in enumerate(params.split(", ")))
          + f"  ROOT %pallas_call.1 = {output} custom-call({operands}), custom_call_target=\"__gpu$xla.gpu.triton\", "
          f'backend_config={{name = "{name}"}}, metadata={{op_name="jit(train_step)/momentum_forward/pallas_call"}}\n}}\n')


def test_time_model_reads_the_projection_once_and_counts_the_kernels_work():
  b, t, heads, d = 50, 32, 12, 64
  text = _triton_call(f"{da.KERNEL_NAME}_h{heads}", f"bf16[{b},{t},{heads * d}]{{2,1,0}}",
                      "%k, %m, %p, %p, %p, %bq, %bk, %bv",
                      f"k: u32[2], m: s32[{b},{t}], p: bf16[{b},{t},{3 * heads * d}], bq: f32[{heads * d}], "
                      f"bk: f32[{heads * d}], bv: f32[{heads * d}]")
  cost, = kernel_cost.costs(text)
  probabilities = b * heads * t * t
  assert cost.read == 8 + 4 * b * t + 2 * b * t * 3 * heads * d + 3 * 4 * heads * d  # the projection once
  assert cost.written == 2 * b * t * heads * d
  assert cost.flops == 2 * probabilities * d * 2  # QKᵀ and PV
  assert cost.rounds == probabilities * kernel_cost.ROUNDS_PER_HASH  # one hash per probability


def test_time_model_counts_the_backward_kernels_work_and_both_outputs():
  b, t, heads, d = 4, 32, 12, 64
  width = 3 * heads * d
  text = _triton_call(f"{da.BACKWARD_KERNEL_NAME}_h{heads}",
                      f"(bf16[{b},{t},{width}]{{2,1,0}}, f32[{b},{width}]{{1,0}})",
                      "%keep, %m, %p, %p, %p, %bq, %bk, %bv, %g",
                      f"keep: s8[{b},{heads},{t},{t}], m: s32[{b},{t}], p: bf16[{b},{t},{width}], "
                      f"bq: f32[{heads * d}], bk: f32[{heads * d}], bv: f32[{heads * d}], g: bf16[{b},{t},{heads * d}]")
  cost, = kernel_cost.costs(text)
  assert cost.flops == 10 * b * heads * t * t * d and cost.rounds == 0
  assert cost.written == 2 * b * t * width + 4 * b * width


def test_more_than_one_device_keeps_the_explicit_path():
  from micse_jax.configs import default
  from micse_jax.training import networks
  config = default.get_config()
  config.ami.layers = (-1,)
  nets = networks.build_networks(config, _tiny().config)
  assert nets.online.dropout_kernel and nets.momentum.dropout_kernel
  assert networks.for_devices(nets, 1) is nets
  two = networks.for_devices(nets, 2)
  assert not two.online.dropout_kernel and not two.momentum.dropout_kernel
  assert two.online.sow_attention_layers == nets.online.sow_attention_layers and two.momentum.cls_only


@pytest.mark.gpu
def test_on_gpu_the_kernels_run_and_match_reference():
  """On a lent GPU: the compiled program holds both Pallas kernels, the context equals `reference`
  (XLA's program of the explicit path) up to bfloat16 rounding, and so do the gradients."""
  projection, biases, key_mask, words = _inputs(4, batch=4, heads=12)
  cotangent = jax.random.normal(jax.random.PRNGKey(6), (4, T, 12 * D)).astype(jnp.bfloat16)
  heads, rate = 12, 0.1

  def run(fn):
    value, pullback = jax.vjp(lambda p, b: fn(p, b, key_mask, words, rate, heads), projection, biases)
    return value, pullback(cotangent)

  kernels = jax.jit(lambda: run(da.dropout_attention))
  text = kernels.lower().compile().as_text()
  assert f"{da.KERNEL_NAME}_h12" in text and f"{da.BACKWARD_KERNEL_NAME}_h12" in text
  (ctx, (d_projection, d_biases)), (want, (want_projection, want_biases)) = kernels(), jax.jit(
      lambda: run(da.reference))()
  np.testing.assert_allclose(np.asarray(ctx, np.float32), np.asarray(want, np.float32), rtol=2 ** -7, atol=1e-2)
  np.testing.assert_allclose(np.asarray(d_projection, np.float32), np.asarray(want_projection, np.float32),
                             rtol=2 ** -6, atol=2e-2)
  for got, exact in zip(d_biases, want_biases):
    np.testing.assert_allclose(got, exact, rtol=0.05, atol=0.2)
