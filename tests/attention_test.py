"""models/attention.attend on its "xla" and "cudnn" paths equals softmax(QKᵀ/√d + mask)V computed by hand;
cuDNN is never chosen for float32, a head dim it does not take, or a GPU older than Ampere; on a GPU in
bfloat16 the chosen path is cuDNN's kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.kernels import choice
from micse_jax.models import attention
from micse_jax.models.dropout import Dropout


def reference(x, qkv, lengths, heads):
  """Attention in float64 NumPy: scores over the first `lengths[b]` keys only."""
  x = np.asarray(x, np.float64)
  q, k, v = (x @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64) for p in qkv)
  split = lambda t: t.reshape(t.shape[0], t.shape[1], heads, -1)
  q, k, v = split(q), split(k), split(v)
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  keys = np.arange(k.shape[1])[None, None, None, :] < np.asarray(lengths)[:, None, None, None]
  scores = np.where(keys, scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", probs, v)
  return out.reshape(out.shape[0], out.shape[1], -1)


def inputs(b=3, t=12, heads=2, d=16):
  keys = jax.random.split(jax.random.PRNGKey(0), 7)
  x = jax.random.normal(keys[0], (b, t, heads * d))
  qkv = [{"kernel": jax.random.normal(keys[1 + i], (heads * d, heads * d)) / 8,
          "bias": jax.random.normal(keys[4 + i], (heads * d,)) / 8} for i in range(3)]
  lengths = np.array([t, 7, 3])
  key_mask = (np.arange(t)[None, :] < lengths[:, None])[:, None, None, :]
  return x, qkv, jnp.asarray(key_mask), lengths


def _attend(path, dtype, heads=2, d=16):
  x, qkv, key_mask, lengths = inputs(heads=heads, d=d)
  fn = lambda x, qkv, mask: attention.attend(path, x, qkv, mask, Dropout(0.0), True, heads=heads, dtype=dtype)[0]
  return jax.jit(fn), (x, qkv, key_mask), reference(x, qkv, lengths, heads)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
def test_xla_path_is_masked_softmax_attention(dtype, tol):
  fn, args, want = _attend("xla", dtype)
  np.testing.assert_allclose(np.asarray(fn(*args), np.float64), want, atol=tol, rtol=tol)


def test_cudnn_is_never_asked_for_float32_odd_head_dims_or_pre_ampere_gpus():
  assert not choice.cudnn_takes((2, 8, 2, 64), (2, 8, 2, 64), (2, 1, 8, 8), "float32")
  assert not choice.cudnn_takes((2, 8, 2, 12), (2, 8, 2, 12), (2, 1, 8, 8), "bfloat16")  # 12 % 8
  assert not choice.cudnn_takes((2, 8, 1, 256), (2, 8, 1, 256), (2, 1, 8, 8), "bfloat16")  # > 128
  layer = dict(explicit=False, reads_probabilities=False, dropout=False, q_shape=(2, 8, 2, 64),
               k_shape=(2, 8, 2, 64), dtype=jnp.float16)
  v100 = choice.Target("cuda", (7, 0))
  assert choice.attention_path(v100, **layer) == "xla"
  assert choice.attention_path(choice.Target("tpu"), **layer) == "xla"


@pytest.mark.gpu
def test_on_gpu_bfloat16_attention_is_cudnn_and_correct():
  target = choice.local_target()
  if target.compute_capability and not target.ampere_or_newer:
    pytest.skip(f"cuDNN's flash attention needs an Ampere-or-newer GPU, not {target.describe()}")
  path = choice.attention_path(None, explicit=False, reads_probabilities=False, dropout=False,
                               q_shape=(3, 12, 2, 64), k_shape=(3, 12, 2, 64), dtype=jnp.bfloat16)
  assert path == "cudnn"  # an Ampere-or-newer GPU with cuDNN
  fn, args, want = _attend(path, jnp.bfloat16, d=64)
  assert "__cudnn$fmha" in fn.lower(*args).compile().as_text()
  np.testing.assert_allclose(np.asarray(fn(*args), np.float64), want, atol=5e-2, rtol=5e-2)
