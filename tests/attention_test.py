"""models/attention.py: the fused attention equals softmax(QKᵀ/√d + mask)V computed by hand; cuDNN is
never asked for float32 or a head dim it does not take; on a GPU in bfloat16 it is cuDNN's kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.models import attention


def reference(q, k, v, lengths):
  """Attention in float64 NumPy: scores over the first `lengths[b]` keys only."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  keys = np.arange(k.shape[1])[None, None, None, :] < np.asarray(lengths)[:, None, None, None]
  scores = np.where(keys, scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", probs, v)


def inputs(dtype, b=3, t=12, heads=2, d=16):
  q, k, v = (jax.random.normal(key, (b, t, heads, d), dtype) for key in jax.random.split(jax.random.PRNGKey(0), 3))
  lengths = np.array([12, 7, 3])
  key_mask = (np.arange(t)[None, :] < lengths[:, None])[:, None, None, :]
  return q, k, v, jnp.asarray(key_mask), lengths


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_fused_attention_is_masked_softmax_attention(dtype, tol):
  q, k, v, key_mask, lengths = inputs(dtype)
  out = jax.jit(attention.fused_attention)(q, k, v, key_mask)
  np.testing.assert_allclose(np.asarray(out, np.float64), reference(q, k, v, lengths), atol=tol, rtol=tol)


def test_cudnn_is_never_asked_for_float32_or_odd_head_dims():
  assert not attention.cudnn_takes((2, 8, 2, 64), (2, 8, 2, 64), (2, 1, 1, 8), "float32")
  assert not attention.cudnn_takes((2, 8, 2, 12), (2, 8, 2, 12), (2, 1, 1, 8), "bfloat16")  # 12 % 8
  assert not attention.cudnn_takes((2, 8, 1, 256), (2, 8, 1, 256), (2, 1, 1, 8), "bfloat16")  # > 128


@pytest.mark.gpu
def test_on_gpu_bfloat16_attention_is_cudnn_and_correct():
  q, k, v, key_mask, lengths = inputs(jnp.bfloat16, d=64)
  fn = jax.jit(attention.fused_attention)
  assert "__cudnn$fmha" in fn.lower(q, k, v, key_mask).compile().as_text()
  np.testing.assert_allclose(np.asarray(fn(q, k, v, key_mask), np.float64), reference(q, k, v, lengths),
                             atol=3e-2, rtol=3e-2)
