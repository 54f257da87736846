"""The Flax modules one train step needs, built once from the config and the BERT config.

Which modules exist depends on the method: every config has the online encoder and the MLP
head; miCSE/MoCo add the momentum encoder; ADD adds an attention-reading copy of the encoder
(no dropout, every layer sown); the MLM auxiliary adds the online encoder with its MLM head;
InfoCSE adds the frozen lower half of the initial encoder and the auxiliary network.
"""
from __future__ import annotations

import dataclasses

from micse_jax.models.bert import BertConfig, BertModel
from micse_jax.models.heads import MLPHead
from micse_jax.models.infocse import InfoCSEAuxiliary, lower_half_layers


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  """Token ids the views and masks need (from the checkpoint's tokenizer)."""
  cls_id: int
  sep_id: int
  mask_id: int
  vocab_size: int

  @classmethod
  def from_tokenizer(cls, tokenizer, vocab_size: int) -> "SpecialTokens":
    hf = tokenizer.hf
    return cls(int(hf.cls_token_id), int(hf.sep_token_id), int(hf.mask_token_id), vocab_size)


def resolve_layers(layers, num_layers: int) -> tuple[int, ...]:
  """0-based layer indices; negative ones count from the top (-1 = last layer)."""
  if not layers or any(not -num_layers <= i < num_layers for i in layers):
    raise ValueError(f"ami.layers {tuple(layers)} invalid for a {num_layers}-layer encoder")
  resolved = sorted({i % num_layers for i in layers})
  if len(resolved) != len(layers):
    raise ValueError(f"ami.layers {tuple(layers)} name a layer twice")
  return tuple(resolved)


@dataclasses.dataclass(frozen=True)
class Networks:
  """Online encoder (sows the AMI layers), momentum encoder, MLP head, and per-method extras."""
  online: BertModel
  momentum: BertModel
  head: MLPHead
  ami_layers: tuple[int, ...]
  tokens: SpecialTokens | None = None
  importance: BertModel | None = None        # ADD: deterministic, every layer's attention sown
  with_mlm_head: BertModel | None = None     # MLM auxiliary: online encoder + `cls` head
  infocse_lower: BertModel | None = None     # InfoCSE: lower half of the frozen initial encoder
  infocse_aux: InfoCSEAuxiliary | None = None


def compute_dtype(config):
  from micse_jax.training import precision  # pylint: disable=import-outside-toplevel
  return precision.compute_dtype(config.model.dtype)


def model_options(config) -> dict:
  """BertModel keyword arguments from `config.model`: compute dtype, attention kernel, remat."""
  return {"dtype": compute_dtype(config), "attention": config.model.get("attention", "fused"),
          "remat": config.model.get("remat", "none")}


def build_networks(config, bert_config: BertConfig, tokens: SpecialTokens | None = None) -> Networks:
  dtype = compute_dtype(config)
  options = model_options(config)
  ami_layers = resolve_layers(config.ami.layers, bert_config.num_hidden_layers) if config.ami.enabled else ()
  bert_config = bert_config.replace(dropout_random_bits=config.model.dropout_random_bits)
  p = config.momentum.dropout
  momentum_config = bert_config.replace(hidden_dropout_prob=p, attention_probs_dropout_prob=p)
  extras = {}
  if config.view.kind == "add":
    extras["importance"] = BertModel(bert_config, sow_attention_layers=tuple(range(bert_config.num_hidden_layers)),
                                     add_pooler=False, **options)
  if config.mlm.enabled:
    extras["with_mlm_head"] = BertModel(bert_config, add_pooler=False, add_mlm_head=True, **options)
  if config.infocse.enabled:
    lower = bert_config.replace(num_hidden_layers=lower_half_layers(bert_config.num_hidden_layers))
    extras["infocse_lower"] = BertModel(lower, add_pooler=False, **options)
    extras["infocse_aux"] = InfoCSEAuxiliary(bert_config, config.infocse.num_layers, dtype=dtype)
  return Networks(
      online=BertModel(bert_config, sow_attention_layers=ami_layers, **options),
      momentum=BertModel(momentum_config, **options),
      head=MLPHead(bert_config.hidden_size, bert_config.initializer_range, dtype=dtype),
      ami_layers=ami_layers, tokens=tokens, **extras)
