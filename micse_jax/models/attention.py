"""BERT self-attention as one op over every path: `attend` computes a layer's context from its input
and its query, key and value parameters by the path `kernels/choice.attention_path` picks for it.

    ctx = dropout(softmax(Q·Kᵀ/√d + mask))·V        (Vaswani et al. 2017, Eq. 1; HF BERT)

"explicit": the probabilities as XLA ops (`kernels/explicit_attention.py`), returned for sowing
(float32 for a sown layer, the compute dtype otherwise), then dropped by the layer's `Dropout`;
"dropout_kernel": the Pallas kernels (`kernels/dropout_attention.py`), which draw the same dropout
bits from the same site key (for a sown layer they also return its float32 dropped probabilities
and take their gradient); "cudnn" and "xla": `jax.nn.dot_product_attention` by name (cuDNN's
flash attention, or XLA's own softmax), for layers without dropout whose probabilities nothing
reads. `jax.nn.dot_product_attention` has no dropout argument, and jax offers no public cuDNN
attention with dropout on the probabilities: a layer that trains with attention dropout takes
the explicit path or the kernels. The query, key and value projections run as one GEMM
(`dense.fused_dense`) over their three HF-named parameter sets.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from micse_jax.kernels import explicit_attention
from micse_jax.kernels.dropout_attention import dropout_attention
from micse_jax.models import row_block
from micse_jax.models.dense import fused_dense, fused_projection


def _split_heads(t, heads: int):
  return t.reshape(t.shape[:2] + (heads, t.shape[-1] // heads))  # [B, T, heads, d]


def attend(path: str, x, qkv: Sequence[dict], key_mask, drop, deterministic: bool, *, heads: int, dtype,
           rows: int | None = None, float32_probs: bool = False, interpret: bool = False, mesh=None):
  """(context `[B, T', H]` of the first `rows` queries (every one when None), the dropped probabilities
  `[B, heads, T, T]` of the explicit path, those of the kernels with `float32_probs` (a sown layer),
  or None). x: `[B, T, H]`; qkv: the query, key and value
  `{"kernel", "bias"}`; key_mask: bool `[B, 1, 1, T]`, True for real keys; drop: the layer's
  `models/dropout.Dropout` (its site key feeds the kernels); interpret, mesh: how the kernels run
  (`kernels/dropout_attention.dropout_attention`)."""
  queries = slice(0, rows)
  if path == "dropout_kernel":
    projection, biases = fused_projection(x, qkv, dtype)
    block = row_block.current()  # a block of a batch's rows draws the batch's bits at its rows
    out = dropout_attention(projection, biases, key_mask[:, 0, 0, :], drop.site_rng(), drop.rate, heads,
                            interpret=interpret, mesh=mesh, probabilities=float32_probs,
                            rows=None if block is None else (block.index, block.count))
    ctx, probs = out if float32_probs else (out, None)
    return ctx[:, queries], probs
  q, k, v = (_split_heads(t, heads) for t in fused_dense(x, qkv, dtype))  # one GEMM for the three
  if path in ("cudnn", "xla"):
    mask = key_mask if path == "xla" else jnp.broadcast_to(key_mask, key_mask.shape[:2] + (q[:, queries].shape[1],
                                                                                          k.shape[1]))
    ctx = jax.nn.dot_product_attention(q[:, queries], k, v, mask=mask, implementation=path)
    return ctx.reshape(ctx.shape[:2] + (-1,)), None
  q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [B, heads, T, d]
  probs = explicit_attention.probabilities(q, k, key_mask)
  if not float32_probs:
    probs = probs.astype(dtype)
  probs = drop(probs, deterministic=deterministic)
  return explicit_attention.context(probs[:, :, queries].astype(dtype), v), probs
