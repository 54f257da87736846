"""The dropout-attention kernels (`kernels/dropout_attention.py`) and the rules that choose them
(`kernels/choice.py`), run here in Pallas' interpreter and, marked `gpu`, on a lent GPU: their dropout
bits against JAX's own generator, their context against a float64 NumPy attention and against
`reference` (the explicit path's arithmetic) at every tested length, head dim and dtype, their
gradient against JAX's autodiff of `reference`, per population member under `vmap`, inside a BERT
(plain, remat `layer` and `full`) and inside the whole miCSE loss against the explicit path; which
path each device, dtype, shape and generator gets; the time model's account of the kernels."""
import dataclasses
import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.aot import hlo_module, kernel_cost
from micse_jax.kernels import choice
from micse_jax.kernels import dropout_attention as da
from micse_jax.models.bert import BertModel, collect_attentions
from micse_jax.models.bert_config import BertConfig
from micse_jax.models.policy import Policy

B, T, HEADS, D = 3, 32, 2, 64
INTERPRET = choice.Target(interpret=True)
# (length, head dim, dtype): every tested length, head dim and dtype at least once (`choice.KERNEL_*`)
SHAPES = [(32, 64, jnp.bfloat16), (16, 64, jnp.bfloat16), (64, 32, jnp.float16), (128, 128, jnp.bfloat16),
          (128, 32, jnp.float16), (16, 128, jnp.float16)]
SHAPE_IDS = [f"T{t}-d{d}-{jnp.dtype(dt).name}" for t, d, dt in SHAPES]
ULP = {"bfloat16": 2 ** -8, "float16": 2 ** -11}  # half a unit in the last place, relative


def _inputs(seed=0, batch=B, heads=HEADS, length=T, head_dim=D, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  projection = (2 * jax.random.normal(keys[0], (batch, length, 3 * heads * head_dim))).astype(dtype)
  biases = tuple(jax.random.normal(k, (heads * head_dim,)) for k in jax.random.split(keys[1], 3))
  lengths = jnp.array([length, length * 19 // 32, 1, length * 7 // 32, length][:batch])
  key_mask = jnp.arange(length)[None, :] < lengths[:, None]
  words = jax.random.key_data(jax.random.PRNGKey(seed + 100))
  return projection, biases, key_mask, words


def _bernoulli(words, rate, shape):
  return jax.random.bernoulli(jax.random.wrap_key_data(words), 1.0 - rate, shape)


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
  keep = _bernoulli(words, rate, shape)
  np.testing.assert_array_equal((bits >> 9) < da.keep_below(rate), keep)
  assert abs(float(keep.mean()) - (1 - rate)) < 0.01


def _numpy_attention(projection, biases, key_mask, keep, rate, heads=HEADS):
  """softmax(QKᵀ/√d + mask) dropped by `keep`, times V, in float64 (no intermediate rounding)."""
  qkv = np.asarray(projection, np.float64) + np.concatenate(
      [np.asarray(b.astype(projection.dtype), np.float64) for b in biases])
  batch, length, width = qkv.shape
  head_dim = width // (3 * heads)
  q, k, v = (t.reshape(batch, length, heads, head_dim).transpose(0, 2, 1, 3) for t in np.split(qkv, 3, axis=-1))
  scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim)
  scores = np.where(np.asarray(key_mask)[:, None, None, :], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  probs = np.where(np.asarray(keep), probs / (1 - rate), 0.0)
  return (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, heads * head_dim)


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_reference_is_attention_with_bernoulli_dropout(rate):
  projection, biases, key_mask, words = _inputs()
  keep = _bernoulli(words, rate, (B, HEADS, T, T))
  ctx = da.reference(projection, biases, key_mask, words, rate, HEADS)
  expected = _numpy_attention(projection, biases, key_mask, keep, rate)
  error = np.asarray(ctx, np.float64) - expected
  # bfloat16 scores (a unit is 1/16 at |s| ~ 4) move a probability by a few percent at most
  assert np.linalg.norm(error) / np.linalg.norm(expected) < 0.01
  assert np.abs(error).max() < 0.2


@pytest.mark.parametrize("length,head_dim,dtype", SHAPES, ids=SHAPE_IDS)
def test_forward_kernel_is_reference_and_its_mask_is_bernoullis(length, head_dim, dtype):
  rate = 0.1
  projection, biases, key_mask, words = _inputs(1, length=length, head_dim=head_dim, dtype=dtype)
  ctx, keep = da._pallas(projection, biases, key_mask, words, rate, HEADS, save_keep=True, interpret=True)
  want_ctx = da.reference(projection, biases, key_mask, words, rate, HEADS)
  want_keep = _bernoulli(words, rate, (B, HEADS, length, length))
  np.testing.assert_array_equal(keep, want_keep.astype(jnp.int8))
  assert abs(float(np.mean(keep)) - (1 - rate)) < 4 / math.sqrt(keep.size)  # four standard errors at most
  got, want = np.asarray(ctx, np.float32), np.asarray(want_ctx, np.float32)
  if dtype == jnp.bfloat16:  # the same roundings: a float32 sum over 128 terms in another order may move a unit
    assert np.mean(got != want) < 1e-3
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=0)
  # XLA:CPU keeps float16 chains in float32 (the scores' scaling a multiply, unrounded): not bit for bit,
  # and the kernel is as close to the exact attention as XLA's program is
  _assert_as_accurate(ctx, want_ctx, _numpy_attention(projection, biases, key_mask, keep, rate))


def _assert_close_in_norm(got, want, rtol):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.linalg.norm(got - want) <= rtol * np.linalg.norm(want), np.linalg.norm(got - want) / np.linalg.norm(want)


def _assert_as_accurate(got, want, exact):
  """`got` is as close to the float64 `exact` as XLA's program of the same arithmetic (`want`) is."""
  error = lambda x: np.linalg.norm(np.asarray(x, np.float64) - exact)
  assert error(got) <= 1.5 * error(want) + 1e-6 * np.linalg.norm(exact), (error(got), error(want))


def _assert_gradients_match(got_projection, got_biases, want_projection, want_biases, dtype, op_by_op=True):
  """The kernels' gradient against JAX's autodiff of `reference`: the same roundings, float32 sums
  in another order moving a few values by a unit of `dtype` (`op_by_op`: `reference` run op by op,
  so that almost every value is equal; a compiled one keeps some intermediates in float32); the bias
  gradients are the projection gradient's column sums taken in float32 (autodiff of `reference`
  sums in `dtype`)."""
  ulp = ULP[jnp.dtype(dtype).name]
  got, want = np.asarray(got_projection, np.float32), np.asarray(want_projection, np.float32)
  if op_by_op:
    np.testing.assert_allclose(got, want, rtol=4 * ulp, atol=4 * ulp * np.abs(want).max())
    if jnp.dtype(dtype) == jnp.bfloat16:  # XLA:CPU rounds bfloat16 op by op (float16: in float32)
      assert np.mean(got != want) < 0.02
  else:  # a rare value of P·(dP − Σ P·dP) cancels: judged over the whole array
    _assert_close_in_norm(got, want, 4 * ulp)
  rows = tuple(range(got.ndim - 1))
  column_sums = np.split(np.asarray(got_projection, np.float64).sum(axis=rows), 3)
  magnitude = np.abs(got).sum(axis=rows).max()  # what a sum's rounding errors scale with
  for g, w, exact in zip(got_biases, want_biases, column_sums):
    assert g.dtype == w.dtype == jnp.float32
    np.testing.assert_allclose(g, exact, rtol=2 * ulp, atol=2 ** -18 * magnitude)  # float32 sums, then `dtype`
    np.testing.assert_allclose(w, exact, rtol=0.05, atol=0.05 * magnitude)  # summed in `dtype`


@pytest.mark.parametrize("length,head_dim,dtype", SHAPES, ids=SHAPE_IDS)
def test_backward_kernel_is_autodiff_of_reference(length, head_dim, dtype):
  projection, biases, key_mask, words = _inputs(2, length=length, head_dim=head_dim, dtype=dtype)
  rate = 0.1
  cotangent = jax.random.normal(jax.random.PRNGKey(3), (B, length, HEADS * head_dim)).astype(dtype)
  _, keep = da._pallas(projection, biases, key_mask, words, rate, HEADS, save_keep=True, interpret=True)
  got = da._pallas_backward(projection, biases, key_mask, keep, cotangent, rate, HEADS, interpret=True)
  want = jax.vjp(lambda p, b: da.reference(p, b, key_mask, words, rate, HEADS), projection, biases)[1](cotangent)
  _assert_gradients_match(*got, *want, dtype)


SOWN_SHAPES = [(32, 64, jnp.bfloat16), (16, 128, jnp.float16)]


@pytest.mark.parametrize("length,head_dim,dtype", SOWN_SHAPES, ids=[f"T{t}-d{d}-{jnp.dtype(x).name}"
                                                                    for t, d, x in SOWN_SHAPES])
def test_forward_kernel_returns_a_sown_layers_float32_dropped_probabilities(length, head_dim, dtype):
  """A sown layer's kernels: the context as the explicit path's sown layer computes it (probabilities
  dropped in float32, cast for the context) and its dropped probabilities, zero exactly where the
  keep mask says and 1/(1 − rate) times the float64 softmax of the rounded scores elsewhere."""
  rate = 0.1
  projection, biases, key_mask, words = _inputs(8, length=length, head_dim=head_dim, dtype=dtype)
  ctx, keep, probs = da._pallas(projection, biases, key_mask, words, rate, HEADS, save_keep=True,
                                interpret=True, save_probs=True)
  want_ctx, want_probs = da.reference(projection, biases, key_mask, words, rate, HEADS, probabilities=True)
  assert probs.dtype == want_probs.dtype == jnp.float32
  np.testing.assert_array_equal(keep, _bernoulli(words, rate, probs.shape).astype(jnp.int8))
  np.testing.assert_array_equal(np.asarray(probs) == 0, ~np.asarray(keep, bool) | ~np.asarray(key_mask)[:, None, None])
  exact = np.where(np.asarray(keep), _numpy_attention_probabilities(projection, biases, key_mask, HEADS), 0.0)
  exact = exact / (1 - rate)
  error = np.asarray(probs, np.float64) - exact
  # the scores are rounded to `dtype` first (a unit is 1/16 at |s| ~ 4): a few percent at most
  assert np.linalg.norm(error) < 0.01 * np.linalg.norm(exact) and np.abs(error).max() < 0.05
  if dtype == jnp.bfloat16:
    np.testing.assert_allclose(probs, want_probs, rtol=2 ** -21, atol=0)  # float32 sums in another order
  _assert_as_accurate(probs, want_probs, exact)  # XLA:CPU keeps float16 scores unrounded (see above)
  got, want = np.asarray(ctx, np.float32), np.asarray(want_ctx, np.float32)
  if dtype == jnp.bfloat16:
    assert np.mean(got != want) < 1e-3
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=0)
  _assert_close_in_norm(ctx, want_ctx, 4 * ULP[jnp.dtype(dtype).name])


def _numpy_attention_probabilities(projection, biases, key_mask, heads):
  """softmax(QKᵀ/√d + mask) `[B, heads, T, T]` in float64."""
  qkv = np.asarray(projection, np.float64) + np.concatenate(
      [np.asarray(b.astype(projection.dtype), np.float64) for b in biases])
  batch, length, width = qkv.shape
  q, k, _ = (t.reshape(batch, length, heads, -1).transpose(0, 2, 1, 3) for t in np.split(qkv, 3, axis=-1))
  scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
  scores = np.where(np.asarray(key_mask)[:, None, None, :], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  return probs / probs.sum(-1, keepdims=True)


@pytest.mark.parametrize("length,head_dim,dtype", SOWN_SHAPES, ids=[f"T{t}-d{d}-{jnp.dtype(x).name}"
                                                                    for t, d, x in SOWN_SHAPES])
def test_backward_kernel_takes_a_sown_layers_probability_gradient(length, head_dim, dtype):
  """The gradient of a sown layer (context and probabilities both read) is JAX's autodiff of
  `reference(probabilities=True)` at both cotangents; the probabilities' own cotangent matters
  (without it the gradient is another)."""
  rate = 0.1
  projection, biases, key_mask, words = _inputs(9, length=length, head_dim=head_dim, dtype=dtype)
  g_ctx = jax.random.normal(jax.random.PRNGKey(10), (B, length, HEADS * head_dim)).astype(dtype)
  g_probs = 4 * jax.random.normal(jax.random.PRNGKey(11), (B, HEADS, length, length))
  _, keep, _ = da._pallas(projection, biases, key_mask, words, rate, HEADS, save_keep=True, interpret=True,
                          save_probs=True)
  got = da._pallas_backward(projection, biases, key_mask, keep, g_ctx, rate, HEADS, interpret=True, d_probs=g_probs)
  pullback = jax.vjp(lambda p, b: da.reference(p, b, key_mask, words, rate, HEADS, probabilities=True),
                     projection, biases)[1]
  _assert_gradients_match(*got, *pullback((g_ctx, g_probs)), dtype)
  without = pullback((g_ctx, jnp.zeros_like(g_probs)))[0]
  assert np.linalg.norm(np.asarray(got[0], np.float32) - np.asarray(without, np.float32)) > 0.1 * np.linalg.norm(
      np.asarray(without, np.float32))


def _check_population_members(interpret: bool):
  """A population vmaps the step over members: each member's context and gradient are its solo
  ones (its own key, its own inputs), through the kernels' custom VJP."""
  members, rate = 3, 0.1
  projection = jnp.stack([_inputs(s)[0] for s in range(members)])
  _, biases, key_mask, _ = _inputs()
  words = jnp.stack([jax.random.key_data(jax.random.PRNGKey(s)) for s in range(members)])
  cotangent = jax.random.normal(jax.random.PRNGKey(7), (members, B, T, HEADS * D)).astype(jnp.bfloat16)

  def member(p, b, w, g):
    ctx, pullback = jax.vjp(lambda p, b: da.dropout_attention(p, b, key_mask, w, rate, HEADS, interpret=interpret),
                            p, b)
    return ctx, pullback(g)
  ctx, (d_projection, d_biases) = jax.jit(jax.vmap(member, in_axes=(0, None, 0, 0)))(projection, biases, words,
                                                                                     cotangent)
  for m in range(members):
    want, pullback = jax.vjp(lambda p, b: da.reference(p, b, key_mask, words[m], rate, HEADS), projection[m], biases)
    if interpret:  # on a GPU XLA's program of `reference` rounds otherwise than the kernels
      np.testing.assert_array_equal(np.asarray(ctx[m], np.float32), np.asarray(want, np.float32))
    _assert_close_in_norm(ctx[m], want, 4 * ULP["bfloat16"])
    _assert_gradients_match(d_projection[m], [b[m] for b in d_biases], *pullback(cotangent[m]), jnp.bfloat16,
                            op_by_op=interpret)
  assert not np.array_equal(np.asarray(ctx[0]), np.asarray(ctx[1]))


def test_each_population_member_draws_its_own_masks_and_gets_its_own_gradient_under_vmap():
  _check_population_members(interpret=True)


def test_a_sown_layers_kernels_under_vmap_give_each_member_its_own_probabilities_and_gradient():
  """A population's sown (AMI) layers: each member's probabilities, context and gradient at both
  cotangents are its solo `reference(probabilities=True)`'s."""
  members, rate = 2, 0.1
  projection = jnp.stack([_inputs(s)[0] for s in range(members)])
  _, biases, key_mask, _ = _inputs()
  words = jnp.stack([jax.random.key_data(jax.random.PRNGKey(20 + s)) for s in range(members)])
  g_ctx = jax.random.normal(jax.random.PRNGKey(21), (members, B, T, HEADS * D)).astype(jnp.bfloat16)
  g_probs = jax.random.normal(jax.random.PRNGKey(22), (members, B, HEADS, T, T))

  def member(p, w, g, gp):
    out, pullback = jax.vjp(lambda p: da.dropout_attention(p, biases, key_mask, w, rate, HEADS, interpret=True,
                                                           probabilities=True), p)
    return out, pullback((g, gp))[0]
  (ctx, probs), d_projection = jax.jit(jax.vmap(member))(projection, words, g_ctx, g_probs)
  for m in range(members):
    (want_ctx, want_probs), pullback = jax.vjp(
        lambda p: da.reference(p, biases, key_mask, words[m], rate, HEADS, probabilities=True), projection[m])
    np.testing.assert_array_equal(np.asarray(ctx[m], np.float32), np.asarray(want_ctx, np.float32))
    np.testing.assert_allclose(probs[m], want_probs, rtol=2 ** -18, atol=0)  # a float32 row sum reassociated
    want, = pullback((g_ctx[m], g_probs[m]))
    np.testing.assert_allclose(np.asarray(d_projection[m], np.float32), np.asarray(want, np.float32),
                               rtol=4 * ULP["bfloat16"], atol=4 * ULP["bfloat16"] * float(np.abs(want).max()))
  assert not np.array_equal(np.asarray(probs[0]), np.asarray(probs[1]))


# ---------------------------------------------------------------- which path each layer takes

H100, A100, V100 = choice.Target("cuda", (9, 0)), choice.Target("cuda", (8, 0)), choice.Target("cuda", (7, 0))


def _path(target, explicit=False, sown=False, dropout=True, length=32, head_dim=64, dtype=jnp.bfloat16, bits=32,
          impl="threefry", remat="none"):
  shape = (4, length, 12, head_dim)
  return choice.attention_path(target, explicit=explicit, reads_probabilities=sown, dropout=dropout, q_shape=shape,
                               k_shape=shape, dtype=dtype, random_bits=bits, rng_impl=impl, remat=remat)


@pytest.mark.parametrize("target,kwargs,path", [
    (H100, {}, "dropout_kernel"), (A100, {"dtype": jnp.float16}, "dropout_kernel"),
    (INTERPRET, {}, "dropout_kernel"),                                 # the interpreter, on any device
    (V100, {"dtype": jnp.float16}, "explicit"),                        # no Triton before Ampere
    (choice.Target("tpu"), {}, "explicit"), (choice.Target("cpu"), {}, "explicit"),
    (choice.Target("rocm"), {}, "explicit"),
    (choice.Target("cuda", (9, 0), devices=8), {}, "dropout_kernel"),   # under shard_map on each device's rows
    (dataclasses.replace(H100, own_kernels=False), {}, "explicit"),   # after the kernels failed to compile
    (H100, {"dtype": jnp.float32}, "explicit"), (H100, {"impl": "rbg"}, "explicit"),
    (H100, {"bits": 16}, "explicit"), (H100, {"length": 48}, "explicit"), (H100, {"length": 256}, "explicit"),
    (H100, {"length": 8}, "explicit"), (H100, {"head_dim": 16}, "explicit"), (H100, {"head_dim": 96}, "explicit"),
    (H100, {"sown": True}, "dropout_kernel"),                          # the kernels return the probabilities too
    (H100, {"sown": True, "dropout": False}, "explicit"),              # cuDNN's and XLA's attention do not
    (V100, {"sown": True, "dtype": jnp.float16}, "explicit"), (H100, {"explicit": True}, "explicit"),
    (H100, {"remat": "layer"}, "explicit"), (H100, {"remat": "full"}, "explicit"),  # not proven on a GPU yet
    (INTERPRET, {"remat": "full"}, "dropout_kernel"),
    (V100, {"dtype": jnp.float16, "dropout": False}, "xla"),           # no cuDNN flash attention either
    (choice.Target("tpu"), {"dropout": False}, "xla"),
    (H100, {"dropout": False, "dtype": jnp.float32}, "xla"),
], ids=lambda v: v.describe() if isinstance(v, choice.Target) else None)
def test_each_layer_takes_the_path_its_target_can_run(target, kwargs, path):
  assert _path(target, **kwargs) == path


@pytest.mark.parametrize("platform,capability,target", [
    ("gpu", "7.0", V100), ("gpu", "9.0", H100), ("cuda", "8.0", A100), ("gpu", None, choice.Target("rocm")),
    ("tpu", None, choice.Target("tpu")), ("cpu", None, choice.Target("cpu"))])
def test_the_target_is_read_from_the_devices(platform, capability, target):
  device = types.SimpleNamespace(platform=platform, compute_capability=capability)
  assert choice.target_of([device]) == target
  assert choice.target_of([device] * 4).devices == 4


def test_deviceless_v100_and_h100_devices_carry_their_compute_capability():
  """The deviceless targets place the program on devices that say their compute capability, so
  `--aot v100` chooses as a real V100 would (needs a CUDA plugin: the extra `aot` or `aot-v100`)."""
  from micse_jax.aot import topology
  pytest.importorskip("jax_plugins", reason="needs a CUDA plugin (extra 'aot' or 'aot-v100')")
  import importlib.util
  name = "v100" if importlib.util.find_spec("jax_cuda12_plugin") else "h100"
  want = {"v100": V100, "h100": H100}[name]
  assert choice.target_of(topology.target_devices(name)) == want



# ---------------------------------------------------------------- inside a BERT and the miCSE loss

def _tiny(policy=Policy(), **kwargs):
  config = BertConfig(vocab_size=50, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=256, attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.1)
  return BertModel(config, dtype=jnp.bfloat16, policy=policy, **kwargs)


def _check_model(remat: str, cls_only: bool, target: choice.Target, exact: bool, sown=(1,)):
  """The kernels for `target` inside a BERT, plain or rematerialised, against the explicit path: the
  same values (bit for bit where `exact`: the same dropout key per site, projection and biases,
  [CLS]-only last layer), the `sown` layers' probabilities (AMI's, which the loss reads here
  too), every parameter gradient to the dtype's rounding."""
  length = 16  # the shortest tested length: the interpreter's kernels are slow
  ids = jax.random.randint(jax.random.PRNGKey(0), (3, length), 1, 50)
  mask = (jnp.arange(length)[None] < jnp.array([length, 10, 5])[:, None]).astype(jnp.int32)
  params = _tiny().init(jax.random.PRNGKey(1), ids, mask)["params"]

  def loss(p, target):
    out, state = _tiny(Policy(remat=remat, target=target), cls_only=cls_only, sow_attention_layers=sown).apply(
        {"params": p}, ids, mask, deterministic=False, rngs={"dropout": jax.random.PRNGKey(3)},
        mutable=["intermediates"])
    probs = collect_attentions(state["intermediates"], sown) if sown else jnp.zeros(())
    return jnp.sum(out.last_hidden_state.astype(jnp.float32) ** 2) + 100 * jnp.sum(jnp.square(probs)), (
        out.last_hidden_state, probs)

  grad = lambda target: jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, target)
  (value, (hidden, probs)), grads = grad(target)
  (want_value, (want_hidden, want_probs)), want_grads = grad(dataclasses.replace(target, own_kernels=False,
                                                                                  interpret=False))
  hidden, want_hidden = np.asarray(hidden, np.float32), np.asarray(want_hidden, np.float32)
  assert probs.dtype == want_probs.dtype
  np.testing.assert_allclose(probs, want_probs, rtol=2 ** -6, atol=2 ** -12)
  if exact:
    np.testing.assert_array_equal(hidden, want_hidden)
    np.testing.assert_allclose(probs, want_probs, rtol=2 ** -21, atol=0)  # float32 sums in another order
    np.testing.assert_allclose(value, want_value, rtol=2 ** -20)
  np.testing.assert_allclose(hidden, want_hidden, rtol=2 ** -6, atol=2 ** -6 * float(np.abs(want_hidden).max()))
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))  # the key bias's gradient is 0 + noise
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=2 ** -5, atol=2 ** -9 * scale)


# "layer" already recomputes the kernels' forward in the backward pass ("full" only recomputes the dense
# matmuls besides): "full" runs with -m slow.
@pytest.mark.parametrize("remat,cls_only", [("none", False), ("layer", True),
                                            pytest.param("full", False, marks=pytest.mark.slow)])
def test_model_with_the_kernels_is_the_explicit_model(remat, cls_only):
  _check_model(remat, cls_only, INTERPRET, exact=True)


@pytest.mark.slow  # ~35 s: the kernels equal the explicit path on one device in the default run
def test_on_four_devices_the_kernels_under_shard_map_are_the_explicit_path_and_the_one_device_model():
  """Data parallelism: on a batch-sharded 4-device mesh the kernels run per device (no activation
  gathered), each shard drawing its rows' bits of the whole batch's draw: the hidden states equal
  the explicit path's on the same 4 devices bit for bit (the same masks, so a shard's offset is
  right), and the 4-device model is as close to the 1-device one as the explicit path's own
  4-device program is (XLA partitions the rest of the model the same way for both;
  tests/dropout_attention_devices_worker.py)."""
  from tests.helpers import run_device_worker
  r = run_device_worker("tests.dropout_attention_devices_worker", devices=4, timeout=600)
  assert r["hidden_vs_plain"] == 0
  # bfloat16 sums split over 4 devices, through a sown layer too: a few units in the worst element
  assert r["hidden_diff"] <= r["plain_hidden_diff"] and r["grad_worst"] <= r["plain_grad_worst"] < 2 ** -5
  assert r["loss_rel"] < 1e-6 and r["all_gathers"] == 0
  assert r["spread_members"]  # a population one member per device: each member's own masks and values


def test_model_takes_the_kernels_on_every_dropout_layer_sown_or_not():
  ids = jnp.ones((2, T), jnp.int32)
  params = _tiny().init(jax.random.PRNGKey(1), ids, ids)["params"]

  def calls(deterministic=False, target=INTERPRET, **kwargs):
    apply = lambda: _tiny(Policy(target=target), **kwargs).apply(
        {"params": params}, ids, ids, deterministic=deterministic, rngs={"dropout": jax.random.PRNGKey(2)},
        mutable=["intermediates"])
    return str(jax.make_jaxpr(apply)()).count(f"{da.KERNEL_NAME}_h2")

  both, sown = calls(), calls(sow_attention_layers=(1,))
  assert both > 0 and sown == both  # a sown layer's kernels return its probabilities too (AMI reads them)
  assert calls(deterministic=True) == 0  # no dropout: cuDNN / XLA's attention
  assert calls(target=choice.Target()) == 0  # a CPU program without the interpreter
  assert calls(target=V100) == 0


def _loss_and_grads(tmp_path, tokenizer_dir, target, batch_size, heads, hidden, dtype="bfloat16", layers=2):
  """The miCSE loss (dropout, AMI on layer 0, momentum encoder, queue) and every gradient of a random
  BERT whose heads are `hidden // heads` wide, computed in `dtype`, its encoders' kernels chosen for
  `target`."""
  from micse_jax.training import networks, run_inputs
  from micse_jax.training.optim import make_optimizer
  from micse_jax.training.step import make_loss_fn, step_keys
  from tests.helpers import write_tiny_hf_checkpoint
  from tests.train_utils import tiny_training_config
  if not (tmp_path / "tiny_model").exists():
    write_tiny_hf_checkpoint(str(tmp_path / "tiny_model"), tokenizer_dir, mlm=False, hidden_size=hidden,
                             num_attention_heads=heads, intermediate_size=4 * hidden, num_hidden_layers=layers)
  config = tiny_training_config(tmp_path, tokenizer_dir, batch_size=batch_size, **{
      "model.max_length": T, "model.dtype": dtype, "ami.layers": (0,)})
  run = run_inputs.prepare(config)
  nets = networks.build_networks(config, run.bert_config, run.tokens, target)
  state = run_inputs.initial_state(config, nets, make_optimizer(config), run.encoder_params)
  batch = {k: jnp.asarray(v) for k, v in run.batches.batch(0).items()}
  args = (state.frozen_params, batch, state.queue, step_keys(state.rng, state.step), state.step)
  with jax.default_matmul_precision("highest"):  # float32 GEMMs in float32 (not TF32 on a GPU)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(make_loss_fn(config, nets), has_aux=True))(
        state.params, *args)
  return float(loss), float(metrics["ami_mi"]), grads


def _assert_same_step(tmp_path, tokenizer_dir, target, batch_size, heads, hidden, rtol):
  """The loss with the kernels equals the explicit path's to `rtol`; every gradient is as close to the
  float32 step's (the same function, the same dropout bits) as the explicit path's bfloat16 one is.
  Equality leaf by leaf would be too strict: the explicit path sums the bias gradients in bfloat16,
  the kernels in float32 (per leaf: ≤ 1.25 times the explicit path's error, plus `rtol` of the
  leaf's norm or, for a gradient that is 0 up to rounding (a key bias: softmax ignores a shift of a
  row), of the whole gradient's)."""
  plain = dataclasses.replace(target, own_kernels=False, interpret=False)
  step = lambda target, dtype="bfloat16": _loss_and_grads(tmp_path, tokenizer_dir, target, batch_size, heads,
                                                          hidden, dtype)
  (loss, mi, grads), (want_loss, want_mi, want_grads) = step(target), step(plain)
  _, _, exact_grads = step(plain, "float32")
  np.testing.assert_allclose(loss, want_loss, rtol=rtol)
  np.testing.assert_allclose(mi, want_mi, rtol=rtol, atol=1e-6)
  norm = lambda x: float(jnp.linalg.norm(jnp.ravel(x).astype(jnp.float32)))
  overall = norm(jnp.concatenate([jnp.ravel(g) for g in jax.tree.leaves(exact_grads)]))
  for (path, got), want, exact in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads),
                                      jax.tree.leaves(exact_grads)):
    slack = rtol * max(norm(exact), 2 ** -10 * overall)
    assert norm(got - exact) <= 1.25 * norm(want - exact) + slack, jax.tree_util.keystr(path)


@pytest.mark.slow
def test_the_miCSE_loss_and_every_gradient_with_the_kernels_are_the_explicit_paths(tmp_path, tiny_real_dir):
  """The whole loss through the interpreter's kernels against the same loss on the explicit path:
  equal to bfloat16 rounding (the forward is the same bit for bit; float32 sums in the kernels'
  backward move single values by a unit, which the rest of the backward carries on)."""
  _assert_same_step(tmp_path, tiny_real_dir, INTERPRET, batch_size=4, heads=2, hidden=128, rtol=2 ** -6)



def _triton_call(name: str, output: str, operands: str, params: str) -> str:
  return (f"HloModule jit_step\n\nENTRY %main ({params}) -> f32[] {{\n"
          + "".join(f"  %{p.split(':')[0]} = {p.split(': ')[1]} parameter({i})\n" for i, p in enumerate(params.split(", ")))
          + f"  ROOT %pallas_call.1 = {output} custom-call({operands}), custom_call_target=\"__gpu$xla.gpu.triton\", "
          f'backend_config={{name = "{name}"}}, metadata={{op_name="jit(train_step)/momentum_forward/pallas_call"}}\n}}\n')


def test_time_model_reads_the_projection_once_and_counts_the_kernels_work():
  b, t, heads, d = 50, 32, 12, 64
  text = _triton_call(f"{da.KERNEL_NAME}_h{heads}", f"bf16[{b},{t},{heads * d}]{{2,1,0}}",
                      "%k, %m, %p, %p, %p, %bq, %bk, %bv",
                      f"k: u32[4], m: s32[{b},{t}], p: bf16[{b},{t},{3 * heads * d}], bq: f32[{heads * d}], "
                      f"bk: f32[{heads * d}], bv: f32[{heads * d}]")
  cost, = kernel_cost.costs(hlo_module.parse(text))
  probabilities = b * heads * t * t
  assert cost.read == 16 + 4 * b * t + 2 * b * t * 3 * heads * d + 3 * 4 * heads * d  # the projection once
  assert cost.written == 2 * b * t * heads * d
  assert cost.flops == 2 * probabilities * d * 2  # QKᵀ and PV
  assert cost.rounds == probabilities * kernel_cost.ROUNDS_PER_HASH  # one hash per probability
  assert cost.measured_factor == kernel_cost.MEASURED_FACTOR["forward"]  # no keep mask: the momentum encoder's


def test_time_model_counts_a_sown_layers_probabilities_written_and_their_gradient_read():
  """A sown layer's forward kernel also writes its float32 probabilities (and is timed as the keep
  mask's forward: its work is the same); its backward reads their float32 gradient."""
  b, t, heads, d = 50, 32, 12, 64
  width, probabilities = 3 * heads * d, b * heads * t * t
  params = (f"k: u32[4], m: s32[{b},{t}], p: bf16[{b},{t},{width}], bq: f32[{heads * d}], "
            f"bk: f32[{heads * d}], bv: f32[{heads * d}]")
  forward, = kernel_cost.costs(hlo_module.parse(_triton_call(
      f"{da.KERNEL_NAME}_h{heads}",
      f"(bf16[{b},{t},{heads * d}]{{2,1,0}}, s8[{b},{heads},{t},{t}]{{3,2,1,0}}, f32[{b},{heads},{t},{t}]{{3,2,1,0}})",
      "%k, %m, %p, %p, %p, %bq, %bk, %bv", params)))
  assert forward.written == 2 * b * t * heads * d + probabilities * (1 + 4)  # context, keep mask, probabilities
  assert forward.flops == 4 * probabilities * d and forward.rounds == probabilities * kernel_cost.ROUNDS_PER_HASH
  assert forward.measured_factor == kernel_cost.MEASURED_FACTOR["forward_keep"]
  backward, = kernel_cost.costs(hlo_module.parse(_triton_call(
      f"{da.BACKWARD_KERNEL_NAME}_h{heads}", f"(bf16[{b},{t},{width}]{{2,1,0}}, f32[{b},{width}]{{1,0}})",
      "%keep, %m, %p, %p, %p, %bq, %bk, %bv, %g, %gp",
      f"keep: s8[{b},{heads},{t},{t}], m: s32[{b},{t}], p: bf16[{b},{t},{width}], bq: f32[{heads * d}], "
      f"bk: f32[{heads * d}], bv: f32[{heads * d}], g: bf16[{b},{t},{heads * d}], gp: f32[{b},{heads},{t},{t}]")))
  assert backward.read == (probabilities + 4 * b * t + 2 * b * t * width + 3 * 4 * heads * d + 2 * b * t * heads * d
                           + 4 * probabilities)  # ... and the probabilities' float32 gradient
  assert backward.flops == 10 * probabilities * d


def test_time_model_counts_the_backward_kernels_work_and_both_outputs():
  b, t, heads, d = 4, 32, 12, 64
  width = 3 * heads * d
  text = _triton_call(f"{da.BACKWARD_KERNEL_NAME}_h{heads}",
                      f"(bf16[{b},{t},{width}]{{2,1,0}}, f32[{b},{width}]{{1,0}})",
                      "%keep, %m, %p, %p, %p, %bq, %bk, %bv, %g",
                      f"keep: s8[{b},{heads},{t},{t}], m: s32[{b},{t}], p: bf16[{b},{t},{width}], "
                      f"bq: f32[{heads * d}], bk: f32[{heads * d}], bv: f32[{heads * d}], g: bf16[{b},{t},{heads * d}]")
  cost, = kernel_cost.costs(hlo_module.parse(text))
  assert cost.flops == 10 * b * heads * t * t * d and cost.rounds == 0
  assert cost.written == 2 * b * t * width + 4 * b * width
  assert cost.measured_factor == kernel_cost.MEASURED_FACTOR["backward"]
  from micse_jax.aot import time_model
  device = time_model.DEVICES["h100"]
  unscaled = time_model.kernel_seconds(dataclasses.replace(cost, measured_factor=1.0), device)
  assert time_model.kernel_seconds(cost, device) == pytest.approx(unscaled * kernel_cost.MEASURED_FACTOR["backward"])


# ---------------------------------------------------------------- on a lent GPU

def _gpu():
  """This GPU's target; a pre-Ampere GPU (it runs the explicit path, `choice.kernels_allowed`) skips,
  one whose compute capability could not be read fails (a misread would turn the kernels off)."""
  target = choice.local_target()
  if target.compute_capability and not target.ampere_or_newer:
    pytest.skip(f"the kernels run on Ampere-or-newer CUDA GPUs only, not {target.describe()}")
  assert target.ampere_or_newer, f"the kernels' GPU tests need an Ampere-or-newer CUDA GPU, not {target.describe()}"
  return target


@pytest.mark.gpu
@pytest.mark.parametrize("length,head_dim,dtype", SHAPES, ids=SHAPE_IDS)
def test_on_gpu_the_kernels_run_and_match_reference(length, head_dim, dtype):
  """On a lent GPU: the compiled program holds both Pallas kernels; the keep mask is
  `jax.random.bernoulli`'s on the device, bit for bit, at its rate; the context and the gradients
  equal `reference` (XLA's program of the explicit path) to the dtype's rounding."""
  _gpu()
  heads, rate, batch = 12, 0.1, 4
  projection, biases, key_mask, words = _inputs(4, batch=batch, heads=heads, length=length, head_dim=head_dim,
                                                dtype=dtype)
  cotangent = jax.random.normal(jax.random.PRNGKey(6), (batch, length, heads * head_dim)).astype(dtype)

  args = (projection, biases, key_mask, words, cotangent)  # arguments, not constants XLA would fold

  def run(fn, keep_mask, projection, biases, key_mask, words, cotangent):
    value, pullback = jax.vjp(lambda p, b: fn(p, b, key_mask, words, rate, heads), projection, biases)
    return value, pullback(cotangent), keep_mask(projection, biases, key_mask, words)

  kernels = jax.jit(functools.partial(run, da.dropout_attention,
                                      lambda *a: da._pallas(*a, rate, heads, save_keep=True)[1]))
  text = kernels.lower(*args).compile().as_text()
  assert f"{da.KERNEL_NAME}_h{heads}" in text and f"{da.BACKWARD_KERNEL_NAME}_h{heads}" in text
  (ctx, (d_projection, d_biases), keep), (want, (want_projection, want_biases), want_keep) = kernels(*args), jax.jit(
      functools.partial(run, da.reference, lambda p, b, m, w: _bernoulli(w, rate, (batch, heads, length, length))))(
          *args)
  np.testing.assert_array_equal(np.asarray(keep), np.asarray(want_keep).astype(np.int8))
  assert abs(float(np.mean(keep)) - (1 - rate)) < 4 / math.sqrt(keep.size)
  _assert_close_in_norm(ctx, want, 4 * ULP[jnp.dtype(dtype).name])
  _assert_gradients_match(d_projection, d_biases, want_projection, want_biases, dtype, op_by_op=False)


@pytest.mark.gpu
def test_on_gpu_a_sown_layers_kernels_return_its_probabilities_and_take_their_gradient():
  """On a lent GPU, BERT-base's heads: the kernels of a sown layer (AMI's) hold both Pallas calls,
  their float32 dropped probabilities and context equal `reference(probabilities=True)`'s (XLA's
  program) to rounding, and so does the gradient at both cotangents."""
  _gpu()
  heads, rate, batch, length, head_dim, dtype = 12, 0.1, 4, 32, 64, jnp.bfloat16
  projection, biases, key_mask, words = _inputs(12, batch=batch, heads=heads, length=length, head_dim=head_dim,
                                                dtype=dtype)
  g_ctx = jax.random.normal(jax.random.PRNGKey(13), (batch, length, heads * head_dim)).astype(dtype)
  g_probs = jax.random.normal(jax.random.PRNGKey(14), (batch, heads, length, length))

  def run(fn, projection, biases, key_mask, words, g_ctx, g_probs):
    value, pullback = jax.vjp(lambda p, b: fn(p, b, key_mask, words, rate, heads, probabilities=True),
                              projection, biases)
    return value, pullback((g_ctx, g_probs))

  args = (projection, biases, key_mask, words, g_ctx, g_probs)
  kernels = jax.jit(functools.partial(run, da.dropout_attention))
  text = kernels.lower(*args).compile().as_text()
  assert f"{da.KERNEL_NAME}_h{heads}" in text and f"{da.BACKWARD_KERNEL_NAME}_h{heads}" in text
  ((ctx, probs), (d_projection, d_biases)) = kernels(*args)
  ((want_ctx, want_probs), (want_projection, want_biases)) = jax.jit(functools.partial(run, da.reference))(*args)
  np.testing.assert_array_equal(np.asarray(probs) == 0, np.asarray(want_probs) == 0)  # the same keep mask
  _assert_close_in_norm(probs, want_probs, 2 ** -18)  # float32 (Triton may divide approximately)
  _assert_close_in_norm(ctx, want_ctx, 4 * ULP["bfloat16"])
  _assert_gradients_match(d_projection, d_biases, want_projection, want_biases, dtype, op_by_op=False)


@pytest.mark.gpu
def test_on_gpu_population_members_keep_their_own_masks_and_gradients():
  _gpu()
  _check_population_members(interpret=False)


@pytest.mark.gpu
def test_on_gpu_a_model_with_the_kernels_is_the_explicit_model():
  _check_model("none", True, _gpu(), exact=False)


@pytest.mark.gpu
@pytest.mark.trial
@pytest.mark.parametrize("remat,cls_only", [("layer", False), ("full", True)])
def test_on_gpu_trial_a_rematerialised_model_with_the_kernels_is_the_explicit_model(remat, cls_only):
  """What `choice.KERNEL_REMAT` waits for: the kernels inside rematerialised layers on a GPU."""
  _check_model(remat, cls_only, dataclasses.replace(_gpu(), trial=True), exact=False)


@pytest.mark.gpu
def test_on_gpu_a_batch_50_step_with_the_kernels_is_the_explicit_paths(tmp_path, tiny_real_dir):
  """BERT-base's heads (12 x 64) at batch 50 x 32 tokens, two layers: the miCSE loss and every
  gradient with the kernels against the explicit path on the same GPU, to bfloat16 rounding."""
  _assert_same_step(tmp_path, tiny_real_dir, _gpu(), batch_size=50, heads=12, hidden=768, rtol=2 ** -5)
