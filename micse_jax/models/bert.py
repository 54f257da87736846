"""A pure-functional Flax linen BERT, numerically the same model as HF `transformers.BertModel`.

Parameter names follow the Hugging Face module tree (`embeddings/word_embeddings`,
`encoder/layer_3/attention/self/query`, ...), so `weights.py` can map checkpoints with one
table. Attention probabilities of the layers listed in `sow_attention_layers` are sown into
the `intermediates` collection (miCSE's AMI regulariser reads them); all other layers are free
to use a fused attention kernel (`attention="fused"`, see `BertSelfAttention`, `models/attention.py`). Layers may be
rematerialised (`remat`, see `models/remat.py`). Each layer's query, key and value projections
run as one GEMM over their three HF-named parameter sets (`dense.fused_dense`; the parameter tree is
HF's, unchanged). LayerNorm is `models/layer_norm.py`'s (flax's parameters, its own VJP on CUDA).
"""
from __future__ import annotations

from typing import Any, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from micse_jax.models import attention
from micse_jax.models.attention import fused_attention
from micse_jax.models.bert_config import ACTIVATIONS, SUPPORTED_MODEL_TYPES, BertConfig  # noqa: F401 (re-export)
from micse_jax.models.dense import Dense, DenseParams, fused_dense, fused_projection  # noqa: F401 (re-exports)
from micse_jax.models.dropout import Dropout
from micse_jax.models.dropout_attention import dropout_attention, kernel_takes
from micse_jax.models.embed import Embed
from micse_jax.models.layer_norm import LayerNorm
from micse_jax.models.remat import remat_layer
from micse_jax.tokenization import TOKEN_KEYS

Array = jax.Array
ATTENTION_KERNELS = ("explicit", "fused")


@flax.struct.dataclass
class BertOutput:
  """What `BertModel` returns: the last layer's states, and the pooler, every layer and MLM logits when asked."""
  last_hidden_state: Array                      # [B, T, H]
  pooler_output: Array | None = None            # [B, H]   dense + tanh on [CLS]
  hidden_states: tuple[Array, ...] | None = None  # embeddings + every layer
  mlm_logits: Array | None = None               # [B, T, vocab]


def _dense(features: int, config: BertConfig, dtype, name: str) -> Dense:
  return Dense(features, nn.initializers.normal(stddev=config.initializer_range), dtype, name=name)


def _layer_norm(config: BertConfig, dtype, name: str = "LayerNorm") -> LayerNorm:
  """flax `nn.LayerNorm`'s parameters and values in fewer kernels (`models/layer_norm.py`)."""
  return LayerNorm(epsilon=config.layer_norm_eps, dtype=dtype, name=name)


def _dropout(config: BertConfig, rate: float) -> Dropout:
  """A dropout site with the config's draw (`dropout_random_bits`) and generator (`dropout_rng_impl`)."""
  return Dropout(rate, config.dropout_random_bits, config.dropout_rng_impl)


def position_ids_for(input_ids: Array, attention_mask: Array, config: BertConfig) -> Array:
  """BERT: 0..T-1. RoBERTa: pad+1+rank among non-pad tokens, pad for padding (HF rule)."""
  if config.model_type == "roberta":
    not_pad = (input_ids != config.pad_token_id).astype(jnp.int32)
    return jnp.cumsum(not_pad, axis=1) * not_pad + config.pad_token_id
  return jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)


class BertEmbeddings(nn.Module):
  """Word + position + token-type embeddings, LayerNorm, dropout (HF `BertEmbeddings`); `attend` ties the MLM decoder."""
  config: BertConfig
  dtype: Any = jnp.float32

  def setup(self):
    c = self.config
    init = nn.initializers.normal(stddev=c.initializer_range)
    self.word_embeddings = Embed(c.vocab_size, c.hidden_size, embedding_init=init, dtype=self.dtype)
    self.position_embeddings = Embed(c.max_position_embeddings, c.hidden_size,
                                     embedding_init=init, dtype=self.dtype)
    self.token_type_embeddings = Embed(c.type_vocab_size, c.hidden_size,
                                       embedding_init=init, dtype=self.dtype)
    self.LayerNorm = _layer_norm(c, self.dtype)
    self.dropout = _dropout(c, c.hidden_dropout_prob)

  def __call__(self, input_ids, token_type_ids, position_ids, deterministic: bool):
    x = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
         + self.token_type_embeddings(token_type_ids))
    return self.dropout(self.LayerNorm(x), deterministic=deterministic)

  def attend(self, hidden: Array) -> Array:
    """Tied MLM decoder: hidden · word_embeddingsᵀ."""
    return self.word_embeddings.attend(hidden)


class BertSelfAttention(nn.Module):
  """Scaled dot-product self-attention softmax(QKᵀ/√d)V; per-element dropout on the probabilities (HF).

  With `attention="fused"`, a layer whose probabilities nothing reads (not sown, and no
  attention-probability dropout in this call) uses `models/attention.fused_attention`: cuDNN's
  flash attention when compiled for an NVIDIA GPU in bfloat16/float16 with a head dim cuDNN
  takes, XLA's `jax.nn.dot_product_attention` otherwise (float32, CPU, TPU). Neither drops
  individual probabilities: a layer that trains with attention dropout takes the explicit path,
  or with `dropout_kernel` `models/dropout_attention.py`'s kernels (on CUDA; the explicit path's
  values, dropout bits and gradient). "explicit" forces the explicit path everywhere. The query,
  key and value projections run as one GEMM (`fused_dense`) over the three HF-named parameter sets.
  """
  config: BertConfig
  sow_probs: bool = False
  dtype: Any = jnp.float32
  attention: str = "fused"
  query_rows: int | None = None
  dropout_kernel: bool = False

  @nn.compact
  def __call__(self, x: Array, key_mask: Array, deterministic: bool) -> Array:
    """x: [B,T,H]; key_mask: bool [B,1,1,T], True for real (non-padding) keys. Returns the context
    [B,T,H], or [B,query_rows,H] of the first `query_rows` queries (every query's probabilities are
    still computed, dropped and sown: AMI reads them)."""
    c = self.config
    heads, head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    split = lambda t: t.reshape(t.shape[:2] + (heads, head_dim))  # [B,T,h,d]
    init = nn.initializers.normal(stddev=c.initializer_range)
    qkv = [DenseParams(c.hidden_size, init, name=n)(x.shape[-1]) for n in ("query", "key", "value")]
    rate, rows = c.attention_probs_dropout_prob, slice(0, self.query_rows)  # every row when query_rows is None
    drop = _dropout(c, rate)
    if (self.dropout_kernel and self.attention == "fused" and not self.sow_probs and not deterministic and rate > 0
        and kernel_takes(x.shape[1], head_dim, self.dtype, drop.random_bits, drop.rng_impl)):
      ctx = dropout_attention(*fused_projection(x, qkv, self.dtype), key_mask[:, 0, 0, :], drop.site_rng(), rate,
                              heads)
      return ctx[:, rows]
    q, k, v = map(split, fused_dense(x, qkv, self.dtype))  # one GEMM for the three projections
    needs_probs = self.attention == "explicit" or self.sow_probs or (not deterministic and rate > 0)
    if not needs_probs:  # nothing needs the probabilities: a fused kernel (cuDNN on GPU where it applies)
      ctx = fused_attention(q[:, rows], k, v, key_mask)
      return ctx.reshape(ctx.shape[:2] + (c.hidden_size,))
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [B,h,T,d]
    probs = attention.probabilities(q, k, key_mask)
    if not self.sow_probs:  # sown (AMI) layers keep float32 probabilities whatever the dtype
      probs = probs.astype(self.dtype)
    probs = drop(probs, deterministic=deterministic)
    if self.sow_probs:
      self.sow("intermediates", "attention_probs", probs)
    return attention.context(probs[:, :, rows].astype(self.dtype), v)


class BertResidualOutput(nn.Module):
  """dense → dropout → LayerNorm(x + residual): HF BertSelfOutput / BertOutput."""
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, residual: Array, deterministic: bool, draw_shape=None) -> Array:
    """`draw_shape`: x is the leading part of an activation of this shape (`Dropout`)."""
    x = _dense(self.config.hidden_size, self.config, self.dtype, "dense")(x)
    x = _dropout(self.config, self.config.hidden_dropout_prob)(x, deterministic=deterministic,
                                                               draw_shape=draw_shape)
    return _layer_norm(self.config, self.dtype)(x + residual)


class BertAttention(nn.Module):
  """Self-attention and its residual output block (HF `BertAttention`), of every token or, with
  `query_rows`, of the first `query_rows` tokens only."""
  config: BertConfig
  sow_probs: bool = False
  dtype: Any = jnp.float32
  attention: str = "fused"
  query_rows: int | None = None
  dropout_kernel: bool = False

  @nn.compact
  def __call__(self, x, key_mask, deterministic: bool):
    ctx = BertSelfAttention(self.config, self.sow_probs, self.dtype, self.attention, self.query_rows,
                            self.dropout_kernel, name="self")(x, key_mask, deterministic)
    return BertResidualOutput(self.config, self.dtype, name="output")(
        ctx, x[:, :ctx.shape[1]], deterministic, draw_shape=x.shape)


class BertLayer(nn.Module):
  """One transformer layer: attention, then the feed-forward block with its residual output (HF
  `BertLayer`); with `cls_only`, of the [CLS] token only past the attention (`BertModel.cls_only`)."""
  config: BertConfig
  sow_probs: bool = False
  dtype: Any = jnp.float32
  attention: str = "fused"
  cls_only: bool = False
  dropout_kernel: bool = False

  @nn.compact
  def __call__(self, x, key_mask, deterministic: bool):
    c = self.config
    attn = BertAttention(c, self.sow_probs, self.dtype, self.attention, 1 if self.cls_only else None,
                         self.dropout_kernel, name="attention")(x, key_mask, deterministic)
    inner = BertIntermediate(c, self.dtype, name="intermediate")(attn)
    return BertResidualOutput(c, self.dtype, name="output")(inner, attn, deterministic, draw_shape=x.shape)


class BertIntermediate(nn.Module):
  """The feed-forward block's expansion: dense to `intermediate_size`, then the activation."""
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    c = self.config
    return ACTIVATIONS[c.hidden_act](_dense(c.intermediate_size, c, self.dtype, "dense")(x))


class BertEncoder(nn.Module):
  """The stack of layers; sows the attention of `sow_attention_layers`, rematerialises per `remat`."""
  config: BertConfig
  sow_attention_layers: tuple[int, ...] = ()
  dtype: Any = jnp.float32
  attention: str = "fused"
  remat: str = "none"
  cls_only: bool = False
  dropout_kernel: bool = False

  @nn.compact
  def __call__(self, x, key_mask, deterministic: bool, output_hidden_states: bool = False):
    hidden_states = [x]
    layer = remat_layer(BertLayer, self.remat)
    last = self.config.num_hidden_layers - 1
    for i in range(self.config.num_hidden_layers):
      x = layer(self.config, i in self.sow_attention_layers, self.dtype, self.attention,
                self.cls_only and i == last, self.dropout_kernel, name=f"layer_{i}")(x, key_mask, deterministic)
      hidden_states.append(x)
    return x, (tuple(hidden_states) if output_hidden_states else None)


class BertPooler(nn.Module):
  """HF pooler: tanh(dense(h_[CLS]))."""
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, hidden: Array) -> Array:
    return jnp.tanh(_dense(self.config.hidden_size, self.config, self.dtype, "dense")(hidden[:, 0]))


class BertPredictionHeadTransform(nn.Module):
  """HF `cls.predictions.transform`: dense → activation → LayerNorm."""
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, hidden: Array) -> Array:
    c = self.config
    x = _dense(c.hidden_size, c, self.dtype, "dense")(hidden)
    return _layer_norm(c, self.dtype)(ACTIVATIONS[c.hidden_act](x))


class BertLMPredictionHead(nn.Module):
  """HF `cls.predictions`: transform + decoder tied to the word embeddings + bias."""
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, hidden: Array, embeddings: BertEmbeddings) -> Array:
    c = self.config
    x = BertPredictionHeadTransform(c, self.dtype, name="transform")(hidden)
    bias = self.param("bias", nn.initializers.zeros, (c.vocab_size,))
    return embeddings.attend(x) + bias.astype(self.dtype)


class BertModel(nn.Module):
  """BERT encoder + pooler (+ optional MLM head).

  Attributes:
    config: the network's `BertConfig`.
    sow_attention_layers: static tuple of 0-based layer indices whose attention probabilities
      are sown into `intermediates` (see `collect_attentions`).
    add_pooler / add_mlm_head: which heads exist in the parameter tree.
    dtype: computation dtype (parameters stay float32).
    attention: "fused" | "explicit" (`BertSelfAttention`); remat: "none" | "layer" | "full"
      (module docstring). Neither changes the parameter tree or the function computed.
    cls_only: the last layer computes only the [CLS] token (position 0) past its attention, so
      `last_hidden_state` is `[B, 1, H]` (the pooler, the MLM head and `hidden_states` see that
      row only). Its [CLS] values are the full model's: the same parameters, the same dropout
      bits (each site draws the full shape's mask and keeps its first row, `Dropout`), the same
      attention probabilities of every query (sown for AMI); the training step, which reads only
      [CLS], leaves out the rest of the last layer (~1/12 of the FFN and attention-output work).
    dropout_kernel: attention layers that train with dropout on their probabilities, which nothing
      reads (not sown), run as one kernel forward and one backward on CUDA
      (`models/dropout_attention.py`): the explicit path's values, dropout bits and gradient.
  """
  config: BertConfig
  sow_attention_layers: tuple[int, ...] = ()
  add_pooler: bool = True
  add_mlm_head: bool = False
  dtype: Any = jnp.float32
  attention: str = "fused"
  remat: str = "none"
  cls_only: bool = False
  dropout_kernel: bool = False

  def setup(self):
    for i in self.sow_attention_layers:
      if not 0 <= i < self.config.num_hidden_layers:
        raise ValueError(f"attention layer {i} out of range for {self.config.num_hidden_layers} layers")
    if self.attention not in ATTENTION_KERNELS:
      raise ValueError(f"unsupported attention {self.attention!r}; expected one of {ATTENTION_KERNELS}")
    self.embeddings = BertEmbeddings(self.config, self.dtype)
    self.encoder = BertEncoder(self.config, tuple(self.sow_attention_layers), self.dtype, self.attention,
                               self.remat, self.cls_only, self.dropout_kernel)
    if self.add_pooler:
      self.pooler = BertPooler(self.config, self.dtype)
    if self.add_mlm_head:
      self.cls = BertMLMHead(self.config, self.dtype)

  def __call__(self, input_ids: Array, attention_mask: Array, token_type_ids: Array | None = None,
               deterministic: bool = True, output_hidden_states: bool = False) -> BertOutput:
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    positions = position_ids_for(input_ids, attention_mask, self.config)
    x = self.embeddings(input_ids, token_type_ids, positions, deterministic)
    key_mask = attention_mask[:, None, None, :] > 0  # broadcast over heads and queries
    x, hidden_states = self.encoder(x, key_mask, deterministic, output_hidden_states)
    return BertOutput(
        last_hidden_state=x,
        pooler_output=self.pooler(x) if self.add_pooler else None,
        hidden_states=hidden_states,
        mlm_logits=self.cls(x, self.embeddings) if self.add_mlm_head else None)


class BertMLMHead(nn.Module):
  """Module named `cls` holding `predictions` (HF BertOnlyMLMHead)."""
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, hidden: Array, embeddings: BertEmbeddings) -> Array:
    return BertLMPredictionHead(self.config, self.dtype, name="predictions")(hidden, embeddings)


def collect_attentions(intermediates: dict, layers: Sequence[int]) -> Array:
  """Stacks sown attention probabilities into `[len(layers), B, heads, T, T]`."""
  encoder = intermediates["encoder"]
  return jnp.stack([encoder[f"layer_{i}"]["attention"]["self"]["attention_probs"][0] for i in layers])


def resolve_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
  """0-based layer indices; negative ones count from the top (-1 = last layer).

  Raises ValueError for an empty list, an index outside the encoder, or a layer named twice.
  """
  if not layers or any(not -num_layers <= i < num_layers for i in layers):
    raise ValueError(f"ami.layers {tuple(layers)} invalid for a {num_layers}-layer encoder")
  resolved = sorted({i % num_layers for i in layers})
  if len(resolved) != len(layers):
    raise ValueError(f"ami.layers {tuple(layers)} name a layer twice")
  return tuple(resolved)


def two_dropout_views(model: BertModel, params, view1: dict, view2: dict, key: Array):
  """One train-mode forward of both views (token batches, `TOKEN_KEYS`), interleaved per
  sentence (`interleave_views`): each row gets its own dropout mask. Returns (hidden1, hidden2
  `[B, T, H]`, att1, att2 `[L, B, heads, T, T]`), the attention of `model.sow_attention_layers`
  (None, None when it sows none)."""
  both = interleave_views({k: view1[k] for k in TOKEN_KEYS}, {k: view2[k] for k in TOKEN_KEYS})
  out, state = model.apply({"params": params}, *(both[k] for k in TOKEN_KEYS), deterministic=False,
                           rngs={"dropout": key}, mutable=["intermediates"])
  hidden1, hidden2 = split_views(out.last_hidden_state)
  if not model.sow_attention_layers:
    return hidden1, hidden2, None, None
  att1, att2 = split_views(collect_attentions(state["intermediates"], model.sow_attention_layers), axis=1)
  return hidden1, hidden2, att1, att2


def interleave_views(view1: dict, view2: dict) -> dict:
  """Rows `[v1_0, v2_0, v1_1, v2_1, ...]` of every array of two token batches
  (`stack(..., 1).reshape(2B, ...)`), not `[view1; view2]`.

  A device that holds sentences i..j of the batch-sharded input holds both views of exactly
  those sentences, so stacking and splitting the views moves no activation between devices;
  and row 2i+v is the same whatever the batch's padded size (per-row random draws too).
  """
  return {k: jnp.stack([view1[k], view2[k]], axis=1).reshape(-1, *view1[k].shape[1:]) for k in view1}


def split_views(x: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
  """Inverse of `interleave_views` along `axis` (size 2B): the two `[..., B, ...]` views."""
  pairs = x.reshape(*x.shape[:axis], x.shape[axis] // 2, 2, *x.shape[axis + 1:])
  return jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)
