"""Attention's pieces: the explicit path's softmax(QKᵀ/√d + mask) and context (`probabilities`,
`context`, for layers whose probabilities are sown or dropped), and fused attention for layers whose
probabilities nothing reads: cuDNN's flash attention on an NVIDIA GPU where cuDNN takes the shape,
XLA's `jax.nn.dot_product_attention` everywhere else.

`jax.nn.dot_product_attention` with `implementation=None` (jax 0.10) lowers to XLA's own
softmax(QKᵀ)V on every platform, GPUs included; cuDNN runs only when asked for by name
(`implementation="cudnn"`), and then refuses what it cannot do: float32, head dims that are no
multiple of 8 or above 128, a machine without cuDNN. `fused_attention` asks for it only where
all of that holds and the program is lowered for CUDA (`jax.lax.platform_dependent`: on CPU and
TPU the XLA branch is the program, unchanged), so the choice holds for a program compiled on
this CPU for a GPU that is not here (`bench/aot.py`) as for one run on a GPU.

No dropout: jax 0.10.2 offers no public cuDNN attention with dropout on the probabilities
(`jax.nn.dot_product_attention` has no dropout argument; only the private
`jax._src.cudnn.fused_attention_stablehlo` takes a `dropout_rate`, with cuDNN's own generator
and a static seed), so layers that train with attention dropout keep the explicit softmax.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
MAX_CUDNN_HEAD_DIM = 128


def probabilities(q, k, key_mask):
  """The explicit path's softmax(QKᵀ/√d + mask), float32, `[B, heads, T, T]` from `[B, heads, T, d]`
  q and k: the scores in their dtype (HF's matmul), padded keys (`key_mask` false or 0, broadcastable
  to the scores) set to float32's minimum (HF's extended mask), so they get exactly zero probability."""
  scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
  scores = jnp.where(key_mask != 0, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(scores, axis=-1)


def context(probs, v):
  """The explicit path's context `[B, T, heads·d]`: the probabilities `[B, heads, T', T]` times
  `[B, heads, T, d]` v, heads folded back into the hidden axis."""
  ctx = jnp.einsum("bhqk,bhkd->bhqd", probs, v).transpose(0, 2, 1, 3)
  return ctx.reshape(ctx.shape[:2] + (-1,))


def _xla(q, k, v, key_mask):
  return jax.nn.dot_product_attention(q, k, v, mask=key_mask, implementation="xla")


def _cudnn(q, k, v, key_mask):
  """cuDNN takes a mask only as a full `[B, 1 or heads, T, S]` bias: the key mask is broadcast to it."""
  full = jnp.broadcast_to(key_mask, key_mask.shape[:2] + (q.shape[1], k.shape[1]))
  return jax.nn.dot_product_attention(q, k, v, mask=full, implementation="cudnn")


@functools.lru_cache(maxsize=None)
def cudnn_takes(q_shape: tuple, k_shape: tuple, mask_shape: tuple, dtype: str) -> bool:
  """Whether cuDNN attention is installed here and accepts these shapes (`[B, T, heads, d]` q/k/v)."""
  head_dim = q_shape[-1]
  if jnp.dtype(dtype) not in CUDNN_DTYPES or head_dim % 8 or head_dim > MAX_CUDNN_HEAD_DIM:
    return False
  spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  try:  # tracing checks the installed cuDNN and its shape rules; nothing runs
    jax.eval_shape(_cudnn, spec(q_shape, dtype), spec(k_shape, dtype), spec(k_shape, dtype),
                   spec(mask_shape, jnp.bool_))
  except (RuntimeError, NotImplementedError, ValueError, TypeError):
    return False
  return True


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array) -> jax.Array:
  """softmax(QKᵀ/√d + mask)V of `[B, T, heads, d]` arrays; `key_mask` bool, broadcastable to `[B, heads, T, T]`.

  cuDNN (flash attention) when lowering for CUDA and `cudnn_takes` the shapes, XLA otherwise."""
  if not cudnn_takes(q.shape, k.shape, key_mask.shape, jnp.dtype(q.dtype).name):
    return _xla(q, k, v, key_mask)
  return jax.lax.platform_dependent(q, k, v, key_mask, cuda=_cudnn, default=_xla)
