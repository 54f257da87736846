"""The training encoders the step runs (`networks.build_networks`: query/key/value as one GEMM, the
LayerNorm and embedding with their own gradients where lowered for CUDA, fused attention in the
layers nothing reads, the [CLS]-only last layer, the dropout-attention kernels) compute, with their
gradient, what a plain BERT computes: written here from flax's `nn.Embed`, `nn.Dense`,
`nn.LayerNorm` and `jax.nn`'s softmax and GELU, differentiated by JAX, on the same parameters
(deterministic: the dropout draws have their own tests, `dropout_test`, `dropout_attention_test`).
On a GPU the same test compares the CUDA branches (custom VJPs, cuDNN attention) with the plain ones."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.configs import micse
from micse_jax.models.bert_config import BertConfig
from micse_jax.models.dense import DenseParams, fused_dense
from micse_jax.training.networks import build_networks

WIDTHS = (16, 8, 16)
SMALL = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                   max_position_embeddings=16)


def separate_dense(x, params, dtype):
  """One `nn.Dense` per parameter set."""
  return tuple(nn.Dense(p["bias"].shape[0], dtype=dtype).apply({"params": p}, x) for p in params)


def _dense(p, x, dtype):
  return nn.Dense(p["bias"].shape[0], dtype=dtype).apply({"params": p}, x)


def _layer_norm(p, x, config, dtype):
  return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=dtype).apply({"params": p}, x)


def _attention(p, x, mask, config, dtype):
  """softmax(QKᵀ/√d + mask)V over every head, padded keys at float32's minimum (HF's extended mask)."""
  b, t, h = x.shape
  heads = config.num_attention_heads
  split = lambda y: y.reshape(b, t, heads, h // heads).transpose(0, 2, 1, 3)
  q, k, v = (split(_dense(p[name], x, dtype)) for name in ("query", "key", "value"))
  scores = (jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(h // heads)).astype(jnp.float32)
  scores = jnp.where(mask[:, None, None, :] > 0, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  return jnp.einsum("bhqk,bhkd->bhqd", probs, v).transpose(0, 2, 1, 3).reshape(b, t, h)


def plain_bert(params, ids, mask, config, dtype):
  """BERT's forward (Devlin et al. 2019; HF `BertModel`, post-LN) in plain flax modules and jax.nn:
  the [CLS] row of the last layer and the pooler's tanh(dense(h_[CLS]))."""
  emb = params["embeddings"]
  embed = lambda name, i: nn.Embed(*emb[name]["embedding"].shape, dtype=dtype).apply({"params": emb[name]}, i)
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  x = embed("word_embeddings", ids) + embed("position_embeddings", positions) + embed("token_type_embeddings",
                                                                                         jnp.zeros_like(ids))
  x = _layer_norm(emb["LayerNorm"], x, config, dtype)
  for i in range(config.num_hidden_layers):
    layer = params["encoder"][f"layer_{i}"]
    attention = layer["attention"]
    ctx = _attention(attention["self"], x, mask, config, dtype)
    x = _layer_norm(attention["output"]["LayerNorm"], _dense(attention["output"]["dense"], ctx, dtype) + x, config,
                    dtype)
    inner = jax.nn.gelu(_dense(layer["intermediate"]["dense"], x, dtype), approximate=False)
    x = _layer_norm(layer["output"]["LayerNorm"], _dense(layer["output"]["dense"], inner, dtype) + x, config, dtype)
  cls = x[:, :1]
  return cls, jnp.tanh(_dense(params["pooler"]["dense"], cls[:, 0], dtype))


def _online(dtype: str, attention: str):
  """The online encoder of a miCSE step (AMI reads layer 0: explicit there, fused above)."""
  config = micse.get_config()
  config.model.dtype, config.model.attention, config.ami.layers = dtype, attention, (0,)
  return build_networks(config, SMALL).online


def _spread(params):
  """Every parameter redrawn at scale 0.5 (BERT's init, 0.02, leaves the GELU and softmax nearly linear)."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
  return tree.unflatten([0.5 * jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)])


def _inputs():
  ids = jax.random.randint(jax.random.PRNGKey(0), (4, 8), 1, SMALL.vocab_size)
  mask = jnp.ones((4, 8), jnp.int32).at[0, 5:].set(0).at[2, 3:].set(0)
  return ids, mask


# The default run keeps float32 with "fused" attention: its encoder runs the explicit path too, in layer 0
# (AMI reads its probabilities), and memory_options_test's fused-equals-explicit test covers the rest of
# the all-explicit case, which runs with -m slow like bfloat16.
@pytest.mark.parametrize("dtype, attention, tol", [("float32", "fused", 2e-5),
                                                   pytest.param("float32", "explicit", 2e-5, marks=pytest.mark.slow),
                                                   pytest.param("bfloat16", "fused", 3e-2, marks=pytest.mark.slow)])
def test_the_training_encoder_and_its_gradient_are_a_plain_berts(dtype, attention, tol):
  model, (ids, mask) = _online(dtype, attention), _inputs()
  params = _spread(model.init(jax.random.PRNGKey(1), ids, mask)["params"])
  compute = jnp.dtype(dtype)

  def ours(p):
    out = model.apply({"params": p}, ids, mask, deterministic=True)
    return out.last_hidden_state, out.pooler_output

  theirs = lambda p: plain_bert(p, ids, mask, SMALL, compute)
  weights = jax.random.normal(jax.random.PRNGKey(2), (SMALL.hidden_size,))
  scalar = lambda f: lambda p: sum(jnp.sum(jnp.sin(y.astype(jnp.float32)) * weights) for y in f(p))
  (cls, pooled), (ref_cls, ref_pooled) = jax.jit(ours)(params), jax.jit(theirs)(params)
  assert cls.shape == (4, 1, SMALL.hidden_size) and cls.dtype == compute
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol,
                                                  atol=tol)
  close(cls, ref_cls)
  close(pooled, ref_pooled)
  grads, ref_grads = jax.jit(jax.grad(scalar(ours)))(params), jax.jit(jax.grad(scalar(theirs)))(params)
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=tol, atol=tol * scale,
                               err_msg=jax.tree_util.keystr(path))


def _param_sets(key):
  keys = jax.random.split(key, 2 * len(WIDTHS))
  return [{"kernel": jax.random.normal(keys[2 * i], (12, w)), "bias": jax.random.normal(keys[2 * i + 1], (w,))}
          for i, w in enumerate(WIDTHS)]


def test_dense_params_initialise_as_nn_dense():
  init = nn.initializers.normal(stddev=0.02)
  ours = DenseParams(8, init).init(jax.random.PRNGKey(3), 5)["params"]
  theirs = nn.Dense(8, kernel_init=init).init(jax.random.PRNGKey(3), jnp.zeros((1, 5)))["params"]
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_dense_equals_separate_dense_and_its_gradient(dtype):
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 12))
  params = _param_sets(jax.random.PRNGKey(1))
  fused, ref = fused_dense(x, params, dtype), separate_dense(x, params, dtype)
  assert [y.shape for y in fused] == [(3, 5, w) for w in WIDTHS] and all(y.dtype == dtype for y in fused)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2  # float32: the dW GEMM sums the rows in another order
  for a, b in zip(fused, ref):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)
  loss = lambda f: lambda p: sum(jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in f(x, p, dtype))
  grads, ref_grads = jax.grad(loss(fused_dense))(params), jax.grad(loss(separate_dense))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=tol, atol=tol), grads, ref_grads)
