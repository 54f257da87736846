"""Self-attention with dropout on its probabilities as one GPU kernel forward and one backward.

    ctx = dropout(softmax(Q·Kᵀ/√d + mask))·V        (Vaswani et al. 2017, Eq. 1; HF BERT's dropout)

`reference` is the arithmetic of `BertSelfAttention`'s explicit path, op for op: scores in the
compute dtype, the mask and softmax in float32, the probabilities cast back, each dropped where
`jax.random.bernoulli(key, 1 − rate, [B, heads, T, T])` says (flax's `Dropout`: the same key,
hence the same bits) and the kept ones scaled by 1/(1 − rate), the context in the compute dtype.

`dropout_attention` runs that as one Pallas (Triton) kernel per (sentence, head): Q, K and V
are read where the fused QKV projection wrote them (`[B, T, 3·heads·d]`, before its bias, which
the kernel adds: no head transposes, no bias kernel), the dropout bits are threefry-2x32 of the
key and each probability's index in the `[B, heads, T, T]` draw (JAX's partitionable threefry,
bit for bit), and the context is written as `[B, T, heads·d]`. Its gradient is a second kernel
that recomputes the probabilities from Q and K (the forward keeps only its keep mask, one byte
per probability: threefry in the backward kernel makes Triton's compile blow up), differentiates
as JAX differentiates `reference` (the same roundings, float32 accumulation) and writes the Q, K
and V gradients where the projection's columns are, with float32 column sums for the biases.
For a layer whose probabilities are sown (AMI reads them, `reference(probabilities=True)`) the
forward kernel also writes the dropped probabilities in float32 and the backward kernel adds their
gradient to the one the context sends them.

Why a kernel: written with XLA ops the same work is, per layer, two head transposes, two batched
GEMMs and the softmax forward, a hoisted threefry kernel, and backward four batched GEMMs, the
softmax's backward, a transpose and a concatenate-transpose of dQKV, each a round trip of the
`[B, heads, T, T]` probabilities or the activations through memory; the kernels keep a (sentence,
head)'s probabilities on chip. Where they run (`kernels/choice.py`): Triton on CUDA GPUs of
compute capability >= 8.0, at the tested shapes, on any number of devices (under `shard_map`, each on
its own rows); the interpreter in tests; `reference` (the explicit path, differentiated by JAX)
everywhere else.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton
from jax.sharding import PartitionSpec as P

from micse_jax.kernels import explicit_attention as attention

# Triton's launch options for both kernels; the kit times other choices (`benchmarks/kit_points.kernel_variants`)
TRITON_OPTIONS = {"num_warps": 4, "num_stages": 1}
KERNEL_NAME = "micse_dropout_attention"  # `aot/kernel_cost.py` prices the kernels by these names
BACKWARD_KERNEL_NAME = "micse_dropout_attention_backward"
_THREEFRY_KEY_PARITY = np.uint32(0x1BD11BDA)
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def keep_below(rate: float) -> int:
  """k such that `jax.random.bernoulli(key, 1 − rate)` keeps a unit exactly when its 32-bit word's
  top 23 bits are < k: bernoulli compares u = (bits >> 9)·2⁻²³ (exact in float32) with p = 1 − rate
  rounded to float32, and u < p ⟺ (bits >> 9) < ⌈p·2²³⌉."""
  p = float(np.float32(1.0 - rate))
  return int(math.ceil(p * 2 ** 23))


def threefry_bits(key0, key1, counts):
  """`jax.random.bits(key, shape, uint32)` at the flat indices `counts` (< 2³²): threefry-2x32
  (Salmon et al. 2011; 20 rounds, key injection every 4) of the counter (0, index), the two output
  words xor-ed, as JAX's partitionable threefry draws 32-bit words."""
  ks = (key0, key1, key0 ^ key1 ^ _THREEFRY_KEY_PARITY)
  x0 = jnp.zeros_like(counts) + ks[0]
  x1 = counts + ks[1]
  for group in range(5):
    for r in _THREEFRY_ROTATIONS[group % 2]:
      x0 = x0 + x1
      x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
      x1 = x0 ^ x1
    x0 = x0 + ks[(group + 1) % 3]
    x1 = x1 + ks[(group + 2) % 3] + np.uint32(group + 1)
  return x0 ^ x1


def reference(projection, biases, key_mask, key, rate: float, heads: int, probabilities: bool = False):
  """The explicit path's context `[B, T, heads·d]` from the fused QKV projection before its biases
  (`[B, T, 3·heads·d]`, `dense.fused_projection`) and the three biases (`[heads·d]` each, cast to
  the projection's dtype as `nn.Dense` casts them), `key_mask` `[B, T]` (nonzero for real keys)
  and the dropout site's threefry key words (`uint32[2]`). With `probabilities` (a sown layer's
  path: AMI reads them), (context, the dropped probabilities `[B, heads, T, T]`): the probabilities
  are then dropped in float32 and cast to the compute dtype only for the context."""
  qkv = projection + jnp.concatenate([b.astype(projection.dtype) for b in biases])
  batch, length, width = qkv.shape
  q, k, v = (t.reshape(batch, length, heads, width // (3 * heads)).transpose(0, 2, 1, 3)
             for t in jnp.split(qkv, 3, axis=-1))
  probs = attention.probabilities(q, k, key_mask[:, None, None, :])
  if not probabilities:
    probs = probs.astype(qkv.dtype)
  keep = jax.random.bernoulli(jax.random.wrap_key_data(key, impl="threefry2x32"), 1.0 - rate, probs.shape)
  dropped = jax.lax.select(keep, probs / (1.0 - rate), jnp.zeros_like(probs))
  ctx = attention.context(dropped.astype(qkv.dtype), v)
  return (ctx, dropped) if probabilities else ctx


def _keep_from_key(counter_ref, heads: int, length: int, rate: float):
  """This (sentence, head)'s keep mask `[T, T]`: `jax.random.bernoulli`'s decisions at the
  probabilities' indices in the `[B, heads, T, T]` draw of the whole batch. `counter_ref`: the key's
  two words and the global index of this call's first sentence (a device's first row)."""
  sentence = counter_ref[2] + pl.program_id(0).astype(jnp.uint32)
  head = pl.program_id(1).astype(jnp.uint32)
  rows = jax.lax.broadcasted_iota(jnp.uint32, (length, length), 0)
  cols = jax.lax.broadcasted_iota(jnp.uint32, (length, length), 1)
  base = (sentence * np.uint32(heads) + head) * np.uint32(length * length)
  bits = threefry_bits(counter_ref[0], counter_ref[1], base + rows * np.uint32(length) + cols)
  return (bits >> np.uint32(9)) < np.uint32(keep_below(rate))


def _probabilities(mask_ref, blocks, biases, keep, *, rate: float, head_dim: int, float32_dropped: bool = False):
  """One (sentence, head)'s `reference` arithmetic up to the dropped probabilities: (q, k, v with
  their biases, the softmax P in float32, the dropped probabilities in q's dtype, or with
  `float32_dropped` (a sown layer) in float32)."""
  q, k, v = (_add(block[...], bias[...].astype(block.dtype)) for block, bias in zip(blocks, biases))
  dtype, length = q.dtype, q.shape[0]
  scores = _dot(q, k, transpose_b=True).astype(dtype)
  scores = _divide(scores, math.sqrt(head_dim)).astype(jnp.float32)
  scores = jnp.where(mask_ref[...][None, :] != 0, scores, jnp.finfo(jnp.float32).min)
  shifted = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  probs = shifted / jnp.sum(shifted, axis=-1, keepdims=True)
  if float32_dropped:
    dropped = jnp.where(keep, probs / np.float32(1.0 - rate), jnp.zeros((length, length), jnp.float32))
  else:
    dropped = jnp.where(keep, _divide(probs.astype(dtype), 1.0 - rate), jnp.zeros((length, length), dtype))
  return q, k, v, probs, dropped


def _forward_kernel(counter_ref, mask_ref, *refs, heads: int, rate: float, head_dim: int, save_keep: bool,
                    save_probs: bool):
  """One (sentence, head)'s context block (the dropped probabilities times V), its keep mask
  (`save_keep`) and its dropped probabilities in float32 (`save_probs`)."""
  inputs, (out_ref, *saved) = refs[:6], refs[6:]
  keep = _keep_from_key(counter_ref, heads, out_ref.shape[0], rate)
  _, _, v, _, dropped = _probabilities(mask_ref, inputs[:3], inputs[3:], keep, rate=rate, head_dim=head_dim,
                                       float32_dropped=save_probs)
  out_ref[...] = _dot(dropped.astype(v.dtype), v).astype(out_ref.dtype)
  if save_keep:
    saved.pop(0)[...] = keep.astype(jnp.int8)
  if save_probs:
    saved.pop(0)[...] = dropped


def _backward_kernel(keep_ref, mask_ref, *refs, heads: int, rate: float, head_dim: int, sown: bool):
  """One (sentence, head)'s gradient, as JAX differentiates `reference` (jax.nn.softmax's VJP:
  P·(dP − Σ P·dP)), written where the projection's Q, K and V columns are; with the block's bias
  gradient (its column sums, float32). `sown`: `reference(probabilities=True)`'s, the dropped
  float32 probabilities' own cotangent (after the context's) added to what the context sends them."""
  inputs, (cotangent_ref, *d_sown_ref), (d_projection_ref, d_bias_ref) = refs[:6], refs[6:-2], refs[-2:]
  keep = keep_ref[...] != 0
  q, k, v, probs, dropped = _probabilities(mask_ref, inputs[:3], inputs[3:], keep, rate=rate, head_dim=head_dim,
                                           float32_dropped=sown)
  dtype, cotangent = q.dtype, cotangent_ref[...]
  d_dropped = _dot(cotangent, v, transpose_b=True).astype(dtype)
  d_v = _dot(dropped.astype(dtype), cotangent, transpose_a=True).astype(dtype)
  if sown:
    d_dropped = d_dropped.astype(jnp.float32) + d_sown_ref[0][...]
    d_probs = jnp.where(keep, d_dropped / np.float32(1.0 - rate), jnp.zeros_like(d_dropped))
  else:
    d_probs = jnp.where(keep, _divide(d_dropped, 1.0 - rate), jnp.zeros_like(d_dropped)).astype(jnp.float32)
  weighted = probs * d_probs
  d_scores = weighted - probs * jnp.sum(weighted, axis=-1, keepdims=True)
  d_scores = jnp.where(mask_ref[...][None, :] != 0, d_scores, 0.0).astype(dtype)
  d_scores = _divide(d_scores, math.sqrt(head_dim))
  d_q = _dot(d_scores, k).astype(dtype)
  d_k = _dot(d_scores, q, transpose_a=True).astype(dtype)
  sentence, head, length = pl.program_id(0), pl.program_id(1), q.shape[0]
  for part, grad in enumerate((d_q, d_k, d_v)):
    columns = pl.ds((part * heads + head) * head_dim, head_dim)
    d_projection_ref[sentence, pl.ds(0, length), columns] = grad
    d_bias_ref[sentence, columns] = jnp.sum(grad.astype(jnp.float32), axis=0)


def _dot(a, b, transpose_a: bool = False, transpose_b: bool = False):
  """a·b of two blocks, accumulated in float32 (as XLA's GEMMs of half-precision operands)."""
  dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _add(x, bias):
  """x + bias in x's (half-precision) dtype, as XLA adds: in float32, rounded back once."""
  return (x.astype(jnp.float32) + bias[None, :].astype(jnp.float32)).astype(x.dtype)


def _divide(x, divisor: float):
  """x / divisor as XLA computes it in x's (half-precision) dtype: the divisor rounded to that dtype,
  the quotient taken in float32 and rounded back (Triton has no bfloat16 division)."""
  rounded = np.float32(np.asarray(divisor, dtype=x.dtype))
  return (x.astype(jnp.float32) / rounded).astype(x.dtype)


def _call(kernel, first_spec, projection, *, heads: int, rate: float, interpret: bool, name: str,
          out_shape, out_specs, extra_specs=(), triton=None, **options):
  """A pallas_call of `kernel` over the (sentence, head) grid: `first_spec` (the key or the keep
  mask), the sentence's key mask, the head's Q, K and V blocks and their biases, `extra_specs`;
  launched with `triton` (Triton's options; `TRITON_OPTIONS` when None)."""
  batch, length, width = projection.shape
  head_dim = width // (3 * heads)
  block = lambda part: pl.BlockSpec((None, length, head_dim), lambda b, h: (b, 0, part * heads + h))
  bias_block = pl.BlockSpec((head_dim,), lambda b, h: (h,))
  in_specs = [first_spec, pl.BlockSpec((None, length), lambda b, h: (b, 0)), block(0), block(1), block(2),
              bias_block, bias_block, bias_block, *extra_specs]
  return pl.pallas_call(
      functools.partial(kernel, heads=heads, rate=rate, head_dim=head_dim, **options), out_shape=out_shape,
      grid=(batch, heads), in_specs=in_specs, out_specs=out_specs,
      compiler_params=pallas_triton.CompilerParams(**(triton or TRITON_OPTIONS)),
      interpret=interpret, name=f"{name}_h{heads}")


def _square_spec(length: int):
  """A (sentence, head)'s `[T, T]` block of a `[B, heads, T, T]` array: the keep mask, a sown layer's
  probabilities and their gradient."""
  return pl.BlockSpec((None, None, length, length), lambda b, h: (b, h, 0, 0))


def _pallas(projection, biases, key_mask, key, rate: float, heads: int, save_keep: bool = False,
            interpret: bool = False, first_row=0, triton=None, save_probs: bool = False):
  """`reference` as one Pallas call of rows that start at row `first_row` of the batch whose dropout
  draw it reproduces (a device's shard of it): its context, then with `save_keep` its int8 keep
  mask, with `save_probs` (`reference(probabilities=True)`) its float32 dropped probabilities; a
  tuple when either is asked for."""
  batch, length, width = projection.shape
  head_dim = width // (3 * heads)
  out_shape = [jax.ShapeDtypeStruct((batch, length, heads * head_dim), projection.dtype)]
  out_specs = [pl.BlockSpec((None, length, head_dim), lambda b, h: (b, 0, h))]
  for saved, dtype in ((save_keep, jnp.int8), (save_probs, jnp.float32)):
    if saved:
      out_shape.append(jax.ShapeDtypeStruct((batch, heads, length, length), dtype))
      out_specs.append(_square_spec(length))
  call = _call(_forward_kernel, pl.BlockSpec((4,), lambda b, h: (0,)), projection, heads=heads, rate=rate,
               interpret=interpret, name=KERNEL_NAME, out_shape=tuple(out_shape), out_specs=tuple(out_specs),
               save_keep=save_keep, save_probs=save_probs, triton=triton)
  counter = jnp.concatenate([key.astype(jnp.uint32), jnp.stack([jnp.asarray(first_row).astype(jnp.uint32),
                                                                jnp.uint32(0)])])  # 4: a power of two
  out = call(counter, key_mask.astype(jnp.int32), projection, projection, projection, *biases)
  return tuple(out) if save_keep or save_probs else out[0]


def _pallas_backward(projection, biases, key_mask, keep, cotangent, rate: float, heads: int,
                     interpret: bool = False, triton=None, d_probs=None):
  """(d projection, d biases) of `reference` at `cotangent` (d context) as one Pallas call: each
  (sentence, head) writes its Q, K, V gradient blocks into `[B, T, 3·heads·d]` and their column
  sums into `[B, 3·heads·d]` float32 partial bias sums, then added over sentences (and rounded to
  the compute dtype, the gradient of the cast bias). `d_probs`: with `reference(probabilities=True)`,
  the float32 cotangent of its dropped probabilities `[B, heads, T, T]`."""
  d_projection, d_bias = _pallas_backward_call(projection, biases, key_mask, keep, cotangent, rate, heads,
                                               interpret=interpret, triton=triton, d_probs=d_probs)
  return d_projection, _bias_gradients(jnp.sum(d_bias, axis=0), biases, projection.dtype)


def _bias_gradients(d_bias, biases, dtype):
  """The three biases' gradients from their float32 column sums `[3·heads·d]` (rounded to the
  compute dtype: the gradient of the cast bias)."""
  return tuple(d.astype(dtype).astype(b.dtype) for d, b in zip(jnp.split(d_bias, len(biases)), biases))


def _pallas_backward_call(projection, biases, key_mask, keep, cotangent, rate: float, heads: int,
                          interpret: bool = False, triton=None, d_probs=None):
  """`_pallas_backward`'s Pallas call: (d projection, the per-sentence float32 bias sums `[B, 3·heads·d]`)."""
  batch, length, width = projection.shape
  head_dim = width // (3 * heads)
  sown = d_probs is not None
  call = _call(_backward_kernel, _square_spec(length), projection, heads=heads, rate=rate, interpret=interpret,
               name=BACKWARD_KERNEL_NAME,
               out_shape=(jax.ShapeDtypeStruct(projection.shape, projection.dtype),
                          jax.ShapeDtypeStruct((batch, width), jnp.float32)),
               out_specs=(pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)),
               extra_specs=(pl.BlockSpec((None, length, head_dim), lambda b, h: (b, 0, h)),
                            *([_square_spec(length)] if sown else [])), triton=triton, sown=sown)
  return call(keep, key_mask.astype(jnp.int32), projection, projection, projection, *biases,
              cotangent, *([d_probs.astype(jnp.float32)] if sown else []))


def _key_words(key):
  """A dropout key's two uint32 words (a typed threefry key or its raw data)."""
  return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


def dropout_attention(projection, biases, key_mask, key, rate: float, heads: int, interpret: bool = False,
                      mesh=None, probabilities: bool = False, rows=None):
  """`reference`'s context, computed by the two kernels (with `interpret`, in Pallas' interpreter);
  with `probabilities`, `reference(probabilities=True)`'s (context, float32 dropped probabilities),
  for a layer whose probabilities are sown (AMI reads them and sends them a gradient of its own).
  Where they run is `kernels/choice.py`'s to say; `reference` is the explicit path elsewhere.

  `mesh`: a 1-D mesh the rows are split over (data parallelism). A Pallas call is a custom call
  XLA's partitioner does not split, so the kernels run under `shard_map` on each device's own rows,
  each call drawing its dropout bits at its rows' indices in the whole batch's draw: a sentence's
  mask and values do not depend on the device count.

  `rows`: None, or (index, count) when the rows are block `index` of `count` of each device's rows of a
  larger pass (`models/row_block.Block`): the bits are drawn at those rows' indices in that pass's draw."""
  words = _key_words(key)
  local_rows = projection.shape[0] // (1 if mesh is None else mesh.size)
  index, count = (0, 1) if rows is None else rows
  start = jnp.asarray(index, jnp.uint32) * np.uint32(local_rows)  # a device's first row: device·stride + start
  if mesh is None or mesh.size == 1:
    return _kernels(projection, biases, key_mask, words, start, rate, heads, interpret, probabilities)
  words = jnp.concatenate([words.astype(jnp.uint32), jnp.stack([start, jnp.uint32(count * local_rows)])])
  return _sharded_kernels(projection, tuple(biases), key_mask, words, mesh, rate, heads, interpret, probabilities)


def _on_rows(mesh, fn, rows_in: int, shared_in: int, outputs: int):
  """`fn` under `shard_map` over `mesh`'s one axis: its first `rows_in` arguments and every output
  split by rows, the next `shared_in` whole."""
  rows, shared = P(mesh.axis_names[0]), P()
  return jax.shard_map(fn, mesh=mesh, in_specs=(rows,) * rows_in + (shared,) * shared_in,
                       out_specs=rows if outputs == 1 else (rows,) * outputs, check_vma=False)


def _sharded_forward(projection, biases, key_mask, words, mesh, rate, heads, interpret, probabilities,
                     save_keep: bool = False):
  """`_pallas` on each device's rows, its dropout bits drawn at its rows' indices in the batch's draw."""
  def on_device(projection, key_mask, words, *biases):
    key, (start, stride) = words[:2], words[2:]  # rows of a block: see `dropout_attention`'s `rows`
    first_row = jax.lax.axis_index(mesh.axis_names[0]).astype(jnp.uint32) * stride + start
    return _pallas(projection, biases, key_mask, key, rate, heads, save_keep=save_keep, interpret=interpret,
                   first_row=first_row, save_probs=probabilities)
  return _on_rows(mesh, on_device, 2, 1 + len(biases), 1 + save_keep + probabilities)(
      projection, key_mask, words, *biases)


# On a mesh the VJP is taken around the `shard_map`s, not inside one: differentiating inside would
# all-reduce each bias gradient of every layer on its own (the transpose of a replicated input) and
# XLA would slice the three apart before and after its combined all-reduce; here each device's
# partial column sums leave the backward `shard_map` as rows, summed once per layer by the partitioner.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _sharded_kernels(projection, biases, key_mask, words, mesh, rate: float, heads: int, interpret: bool,
                     probabilities: bool):
  return _sharded_forward(projection, biases, key_mask, words, mesh, rate, heads, interpret, probabilities)


def _sharded_kernels_forward(projection, biases, key_mask, words, mesh, rate, heads, interpret, probabilities):
  ctx, keep, *probs = _sharded_forward(projection, biases, key_mask, words, mesh, rate, heads, interpret,
                                       probabilities, save_keep=True)
  return (ctx, *probs) if probabilities else ctx, (projection, biases, key_mask, keep)


def _sharded_kernels_backward(mesh, rate, heads, interpret, probabilities, residuals, cotangent):
  projection, biases, key_mask, keep = residuals
  cotangent, *d_probs = cotangent if probabilities else (cotangent,)

  def on_device(projection, key_mask, keep, cotangent, *rest):
    sown, shared = rest[:len(d_probs)], rest[len(d_probs):]
    d_projection, d_bias = _pallas_backward_call(projection, shared, key_mask, keep, cotangent, rate, heads,
                                                 interpret=interpret, d_probs=sown[0] if sown else None)
    return d_projection, jnp.sum(d_bias, axis=0, keepdims=True)
  d_projection, d_bias = _on_rows(mesh, on_device, 4 + len(d_probs), len(biases), 2)(
      projection, key_mask, keep, cotangent, *d_probs, *biases)
  return d_projection, _bias_gradients(jnp.sum(d_bias, axis=0), biases, projection.dtype), None, None


_sharded_kernels.defvjp(_sharded_kernels_forward, _sharded_kernels_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _kernels(projection, biases, key_mask, words, first_row, rate: float, heads: int, interpret: bool,
             probabilities: bool):
  return _pallas(projection, biases, key_mask, words, rate, heads, interpret=interpret, first_row=first_row,
                 save_probs=probabilities)


def _kernels_forward(projection, biases, key_mask, words, first_row, rate, heads, interpret, probabilities):
  ctx, keep, *probs = _pallas(projection, biases, key_mask, words, rate, heads, save_keep=True,
                              interpret=interpret, first_row=first_row, save_probs=probabilities)
  return (ctx, *probs) if probabilities else ctx, (projection, biases, key_mask, keep)


def _kernels_backward(rate, heads, interpret, probabilities, residuals, cotangent):
  projection, biases, key_mask, keep = residuals
  cotangent, *d_probs = cotangent if probabilities else (cotangent,)
  d_projection, d_biases = _pallas_backward(projection, biases, key_mask, keep, cotangent, rate, heads,
                                            interpret=interpret, d_probs=d_probs[0] if d_probs else None)
  return d_projection, d_biases, None, None, None


_kernels.defvjp(_kernels_forward, _kernels_backward)
