"""What each method adds to the step: the Flax modules (`build_networks`) and their initial
parameters (`method_params`), built once from the config and the BERT config.

Networks: every config has the online encoder and the MLP head; miCSE/MoCo add the momentum
encoder; ADD adds an attention-reading copy of the encoder (no dropout, every layer sown); the
MLM auxiliary adds the online encoder with its MLM head; InfoCSE adds the frozen lower half of
the initial encoder and the auxiliary network (both from `training/infocse.py`).

Parameters: `encoder`, `head` always; CT adds `encoder_b`, `head_b` (a second, independently
trained copy); the MLM auxiliary adds `mlm_head` (BERT's `cls` head, from the checkpoint);
InfoCSE adds `infocse` (fresh transformer layers + the checkpoint's MLM head). Frozen:
InfoCSE's `infocse_lower` (embeddings + lower half of the *initial* encoder, never updated).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from micse_jax.kernels.choice import Target
from micse_jax.losses.ami import resolve_layers
from micse_jax.models.bert import BertConfig, BertModel
from micse_jax.models.heads import MLPHead
from micse_jax.models.policy import Policy
from micse_jax.training import infocse as infocse_lib


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  """Token ids the views and masks need (from the checkpoint's tokenizer)."""
  cls_id: int
  sep_id: int
  mask_id: int
  vocab_size: int

  @classmethod
  def from_tokenizer(cls, tokenizer, vocab_size: int) -> "SpecialTokens":
    """The [CLS], [SEP] and [MASK] ids of a `micse_jax.tokenization.Tokenizer`."""
    hf = tokenizer.hf
    return cls(int(hf.cls_token_id), int(hf.sep_token_id), int(hf.mask_token_id), vocab_size)


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
  infocse: infocse_lib.InfoCSENetworks | None = None  # InfoCSE: frozen lower half + auxiliary network


def compute_dtype(config):
  """The config's compute dtype (`model.dtype`) as a jnp dtype."""
  from micse_jax.training import precision
  return precision.compute_dtype(config.model.dtype)


def model_options(config, target: Target | None = None) -> dict:
  """BertModel keyword arguments from `config.model`: the compute dtype and the policy (attention
  mode, remat, and whether the sharded state splits the tables: `mesh.shard_state`) for programs
  compiled for `target` (`kernels/choice.py`; None: this process's device)."""
  split_tables = bool(config.get("mesh", {}).get("shard_state"))
  return {"dtype": compute_dtype(config),
          "policy": Policy(config.model.attention, config.model.remat, target, split_tables)}


def build_networks(config, bert_config: BertConfig, tokens: SpecialTokens | None = None,
                   target: Target | None = None) -> Networks:
  """The modules the config's method needs (see the module docstring), in the compute dtype, for a
  program compiled for `target` (the devices' kernels: `kernels/choice.py`)."""
  dtype = compute_dtype(config)
  options = model_options(config, target)
  ami_layers = resolve_layers(config.ami.layers, bert_config.num_hidden_layers) if config.ami.enabled else ()
  bert_config = bert_config.replace(dropout_random_bits=config.model.dropout_random_bits,
                                   dropout_rng_impl=config.model.rng_impl)
  p = config.momentum.dropout
  momentum_config = bert_config.replace(hidden_dropout_prob=p, attention_probs_dropout_prob=p)
  extras = {}
  if config.view.kind == "add":
    extras["importance"] = BertModel(bert_config, sow_attention_layers=tuple(range(bert_config.num_hidden_layers)),
                                     add_pooler=False, **options)
  if config.mlm.enabled:
    extras["with_mlm_head"] = BertModel(bert_config, add_pooler=False, add_mlm_head=True, **options)
  if config.infocse.enabled:
    extras["infocse"] = infocse_lib.build_networks(config, bert_config, options)
  # The step reads only the [CLS] row of both encoders' outputs (`step.project`, the momentum
  # embedding): their last layer leaves out every other row (`BertModel.cls_only`).
  return Networks(
      online=BertModel(bert_config, sow_attention_layers=ami_layers, cls_only=True, **options),
      momentum=BertModel(momentum_config, cls_only=True, **options),
      head=MLPHead(bert_config.hidden_size, bert_config.initializer_range, dtype=dtype),
      ami_layers=ami_layers, tokens=tokens, **extras)


_copy = lambda tree: jax.tree.map(jnp.copy, tree)


def method_params(config, nets, encoder_params: dict, head_params: dict, seed: int) -> tuple[dict, dict]:
  """Returns (trainable params, frozen params). `encoder_params` may carry the `cls` MLM head."""
  encoder = dict(encoder_params)
  mlm_head = encoder.pop("cls", None)
  params, frozen = {"encoder": encoder, "head": head_params}, {}
  if config.ct.enabled:
    params["encoder_b"], params["head_b"] = _copy(encoder), _copy(head_params)
  if config.mlm.enabled:
    params["mlm_head"] = mlm_head
  if config.infocse.enabled:
    trained, lower = infocse_lib.initial_params(nets.infocse, encoder, mlm_head, seed)
    params[infocse_lib.PARAMS_KEY], frozen[infocse_lib.FROZEN_KEY] = trained, lower
  return params, frozen
