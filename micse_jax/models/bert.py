"""A pure-functional Flax linen BERT, numerically the same model as HF `transformers.BertModel`.

Parameter names follow the Hugging Face module tree (`embeddings/word_embeddings`,
`encoder/layer_3/attention/self/query`, ...), so `weights.py` can map checkpoints with one
table. Attention probabilities of the layers listed in `sow_attention_layers` are sown into
the `intermediates` collection (miCSE's AMI regulariser reads them). How the model computes is
one field, `policy` (`models/policy.py`: the attention mode, rematerialisation and the compile
target); each attention layer takes the path `kernels/choice.py` picks for it through one op,
`models/attention.attend`. The modules it is built from are drop-ins with flax's parameters and
values, shaped for fewer kernels: `Dense` / `fused_dense` (`models/dense.py`: query, key and value
as one GEMM), `LayerNorm` (`models/layer_norm.py`), `Embed` (`models/embed.py`), `Dropout`
(`models/dropout.py`); their docstrings say why each exists and what it equals. They keep flax's
constructors: where their rows and tables lie and which gradients they take (`kernels/choice.py`'s
choice for the target) they read from the policy the model applies them under (`Policy.applied`).
"""
from __future__ import annotations

from typing import Any, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from micse_jax.models import attention
from micse_jax.models.bert_config import ACTIVATIONS, SUPPORTED_MODEL_TYPES, BertConfig  # noqa: F401 (re-export)
from micse_jax.models.dense import Dense, DenseParams
from micse_jax.models.dropout import Dropout
from micse_jax.models.embed import Embed
from micse_jax.models.layer_norm import LayerNorm
from micse_jax.models.policy import Policy
from micse_jax.models.remat import remat_layer

Array = jax.Array

@flax.struct.dataclass
class BertOutput:
  """What `BertModel` returns: the last layer's states, and the pooler, every layer and MLM logits when asked."""
  last_hidden_state: Array                      # [B, T, H]
  pooler_output: Array | None = None            # [B, H]   dense + tanh on [CLS]
  hidden_states: tuple[Array, ...] | None = None  # embeddings + every layer
  mlm_logits: Array | None = None               # [B, T, vocab]


def _dense(features: int, config: BertConfig, dtype, name: str) -> Dense:
  """flax `nn.Dense`'s parameters and values, initialised as BERT's (`models/dense.py`)."""
  return Dense(features=features, kernel_init=nn.initializers.normal(stddev=config.initializer_range), dtype=dtype,
               name=name)


def _layer_norm(config: BertConfig, dtype, name: str = "LayerNorm") -> LayerNorm:
  """flax `nn.LayerNorm`'s parameters and values in fewer kernels (`models/layer_norm.py`)."""
  return LayerNorm(epsilon=config.layer_norm_eps, dtype=dtype, name=name)


def _dropout(config: BertConfig, rate: float) -> Dropout:
  """A dropout site with the config's draw (`dropout_random_bits`) and generator (`dropout_rng_impl`)."""
  return Dropout(rate=rate, random_bits=config.dropout_random_bits, rng_impl=config.dropout_rng_impl)


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
    table = lambda rows: Embed(num_embeddings=rows, features=c.hidden_size, embedding_init=init, dtype=self.dtype)
    self.word_embeddings = table(c.vocab_size)
    self.position_embeddings = table(c.max_position_embeddings)
    self.token_type_embeddings = table(c.type_vocab_size)
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
  """Scaled dot-product self-attention softmax(QKᵀ/√d)V with per-element dropout on the probabilities
  (HF `BertSelfAttention`), of every query or, with `query_rows`, of the first `query_rows` queries
  (every query's probabilities are still computed, dropped and sown: AMI reads them). The path is
  `policy`'s choice for this layer (`kernels/choice.py`); every path computes these values."""
  config: BertConfig
  sow_probs: bool = False
  dtype: Any = jnp.float32
  policy: Policy = Policy()
  query_rows: int | None = None

  @nn.compact
  def __call__(self, x: Array, key_mask: Array, deterministic: bool) -> Array:
    """x: [B,T,H]; key_mask: bool [B,1,1,T], True for real (non-padding) keys. Returns the context
    [B,T,H] ([B,query_rows,H])."""
    c = self.config
    heads = c.num_attention_heads
    init = nn.initializers.normal(stddev=c.initializer_range)
    qkv = [DenseParams(features=c.hidden_size, kernel_init=init, name=n)(x.shape[-1]) for n in ("query", "key", "value")]
    drop = _dropout(c, c.attention_probs_dropout_prob)
    shape = lambda rows: (x.shape[0], rows, heads, c.hidden_size // heads)
    path = self.policy.attention_path(
        reads_probabilities=self.sow_probs, dropout=not deterministic and drop.rate > 0,
        q_shape=shape(self.query_rows or x.shape[1]), k_shape=shape(x.shape[1]), dtype=self.dtype,
        random_bits=drop.random_bits, rng_impl=drop.rng_impl)
    ctx, probs = attention.attend(path, x, qkv, key_mask, drop, deterministic, heads=heads, dtype=self.dtype,
                                  rows=self.query_rows, float32_probs=self.sow_probs,
                                  interpret=self.policy.interpret, mesh=self.policy.mesh)
    if self.sow_probs:  # sown (AMI) layers keep float32 probabilities whatever the dtype
      self.sow("intermediates", "attention_probs", probs)
    return ctx


class BertResidualOutput(nn.Module):
  """dense → dropout → LayerNorm(x + residual): HF BertSelfOutput / BertOutput."""
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, residual: Array, deterministic: bool, length: int | None = None) -> Array:
    """x, residual: `[B, T', ·]`, the first T' of the layer's `length` tokens (all of them when None);
    the dropout mask is those tokens' part of the whole layer's (`Dropout.leading`)."""
    x = _dense(self.config.hidden_size, self.config, self.dtype, "dense")(x)
    x = _dropout(self.config, self.config.hidden_dropout_prob).leading(x, deterministic, length or x.shape[1])
    return _layer_norm(self.config, self.dtype)(x + residual)


class BertAttention(nn.Module):
  """Self-attention and its residual output block (HF `BertAttention`), of every token or, with
  `query_rows`, of the first `query_rows` tokens only."""
  config: BertConfig
  sow_probs: bool = False
  dtype: Any = jnp.float32
  policy: Policy = Policy()
  query_rows: int | None = None

  @nn.compact
  def __call__(self, x, key_mask, deterministic: bool):
    ctx = BertSelfAttention(config=self.config, sow_probs=self.sow_probs, dtype=self.dtype, policy=self.policy,
                            query_rows=self.query_rows, name="self")(x, key_mask, deterministic)
    return BertResidualOutput(config=self.config, dtype=self.dtype, name="output")(
        ctx, x[:, :ctx.shape[1]], deterministic, length=x.shape[1])


class BertLayer(nn.Module):
  """One transformer layer: attention, then the feed-forward block with its residual output (HF
  `BertLayer`); with `cls_only`, of the [CLS] token only past the attention (`BertModel.cls_only`)."""
  config: BertConfig
  sow_probs: bool = False
  dtype: Any = jnp.float32
  policy: Policy = Policy()
  cls_only: bool = False

  @nn.compact
  def __call__(self, x, key_mask, deterministic: bool):
    c = self.config
    with self.policy.applied():  # the policy its layers read (where its rows lie, which gradients)
      attn = BertAttention(config=c, sow_probs=self.sow_probs, dtype=self.dtype, policy=self.policy,
                           query_rows=1 if self.cls_only else None, name="attention")(x, key_mask, deterministic)
      inner = BertIntermediate(config=c, dtype=self.dtype, name="intermediate")(attn)
      return BertResidualOutput(config=c, dtype=self.dtype, name="output")(inner, attn, deterministic,
                                                                          length=x.shape[1])


class BertIntermediate(nn.Module):
  """The feed-forward block's expansion: dense to `intermediate_size`, then the activation."""
  config: BertConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    c = self.config
    return ACTIVATIONS[c.hidden_act](_dense(c.intermediate_size, c, self.dtype, "dense")(x))


class BertEncoder(nn.Module):
  """The stack of layers; sows the attention of `sow_attention_layers`, rematerialises per `policy.remat`."""
  config: BertConfig
  sow_attention_layers: tuple[int, ...] = ()
  dtype: Any = jnp.float32
  policy: Policy = Policy()
  cls_only: bool = False

  @nn.compact
  def __call__(self, x, key_mask, deterministic: bool, output_hidden_states: bool = False):
    hidden_states = [x]
    layer = remat_layer(BertLayer, self.policy.remat)
    last = self.config.num_hidden_layers - 1
    for i in range(self.config.num_hidden_layers):
      x = layer(config=self.config, sow_probs=i in self.sow_attention_layers, dtype=self.dtype, policy=self.policy,
                cls_only=self.cls_only and i == last, name=f"layer_{i}")(x, key_mask, deterministic)
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
    x = BertPredictionHeadTransform(config=c, dtype=self.dtype, name="transform")(hidden)
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
    policy: how it computes (`models/policy.py`: attention mode, remat, compile target); never
      changes the parameter tree or the function computed.
    cls_only: the last layer computes only the [CLS] token (position 0) past its attention, so
      `last_hidden_state` is `[B, 1, H]` (the pooler, the MLM head and `hidden_states` see that
      row only). Its [CLS] values are the full model's: the same parameters, the same dropout
      bits (each site draws the full shape's mask and keeps its first row, `Dropout.leading`), the same
      attention probabilities of every query (sown for AMI); the training step, which reads only
      [CLS], leaves out the rest of the last layer (~1/12 of the FFN and attention-output work).
  """
  config: BertConfig
  sow_attention_layers: tuple[int, ...] = ()
  add_pooler: bool = True
  add_mlm_head: bool = False
  dtype: Any = jnp.float32
  policy: Policy = Policy()
  cls_only: bool = False

  def setup(self):
    for i in self.sow_attention_layers:
      if not 0 <= i < self.config.num_hidden_layers:
        raise ValueError(f"attention layer {i} out of range for {self.config.num_hidden_layers} layers")
    self.embeddings = BertEmbeddings(config=self.config, dtype=self.dtype)
    self.encoder = BertEncoder(config=self.config, sow_attention_layers=tuple(self.sow_attention_layers),
                               dtype=self.dtype, policy=self.policy, cls_only=self.cls_only)
    if self.add_pooler:
      self.pooler = BertPooler(config=self.config, dtype=self.dtype)
    if self.add_mlm_head:
      self.cls = BertMLMHead(config=self.config, dtype=self.dtype)

  def __call__(self, input_ids: Array, attention_mask: Array, token_type_ids: Array | None = None,
               deterministic: bool = True, output_hidden_states: bool = False) -> BertOutput:
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    with self.policy.applied():  # the policy its layers read (where its rows and tables lie, which gradients)
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
    return BertLMPredictionHead(config=self.config, dtype=self.dtype, name="predictions")(hidden, embeddings)


def collect_attentions(intermediates: dict, layers: Sequence[int]) -> Array:
  """Stacks sown attention probabilities into `[len(layers), B, heads, T, T]`."""
  encoder = intermediates["encoder"]
  return jnp.stack([encoder[f"layer_{i}"]["attention"]["self"]["attention_probs"][0] for i in layers])
