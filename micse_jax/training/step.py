"""The one update step: two dropout views → InfoNCE (+ queue) + AMI → AdamW → EMA → enqueue.

miCSE total loss L = L_C + L_D (paper §2): L_C is InfoNCE over the MLP-pooled [CLS] of two
dropout views with in-batch and queue negatives (Eq. 2); L_D = −λ·AMI between the views'
attention maps (Eq. 3–5). Each term is switched by config, so SimCSE, AMI+SimCSE,
MoCo+SimCSE and miCSE are four configs of this one function.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

from micse_jax.data.pipeline import SENTENCE_IDS_KEY, TOKEN_KEYS
from micse_jax.losses.ami import ami_loss
from micse_jax.losses.infonce import info_nce_loss, l2_normalize
from micse_jax.models.bert import BertConfig, BertModel, collect_attentions
from micse_jax.models.heads import MLPHead
from micse_jax.training.ema import ema_update
from micse_jax.training.queue import enqueue, enqueue_ids
from micse_jax.training.state import TrainState


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
  """The modules one step needs: online encoder (sows AMI layers), momentum encoder, MLP head."""
  online: BertModel
  momentum: BertModel
  head: MLPHead
  ami_layers: tuple[int, ...]


def build_networks(config: ml_collections.ConfigDict, bert_config: BertConfig) -> Networks:
  dtype = jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32
  ami_layers = resolve_layers(config.ami.layers, bert_config.num_hidden_layers) if config.ami.enabled else ()
  p = config.momentum.dropout
  momentum_config = bert_config.replace(hidden_dropout_prob=p, attention_probs_dropout_prob=p)
  return Networks(
      online=BertModel(bert_config, sow_attention_layers=ami_layers, dtype=dtype),
      momentum=BertModel(momentum_config, dtype=dtype),
      head=MLPHead(bert_config.hidden_size, bert_config.initializer_range, dtype=dtype),
      ami_layers=ami_layers)


def _views(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Stacks the token arrays twice: one forward pass gives two independent dropout views."""
  return {k: jnp.concatenate([batch[k], batch[k]], axis=0) for k in TOKEN_KEYS}


def make_train_step(config: ml_collections.ConfigDict, nets: Networks, tx: optax.GradientTransformation,
                    schedule: Callable[[Any], Any]) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """Returns the pure (un-jitted) step; `trainer` jits it with shardings and donation."""
  use_ami, use_momentum = config.ami.enabled, config.momentum.enabled
  a = config.ami

  def loss_fn(params, batch, queue, queue_valid, queue_ids, k_drop, k_ami):
    views = _views(batch)
    out, state = nets.online.apply(
        {"params": params["encoder"]}, views["input_ids"], views["attention_mask"], views["token_type_ids"],
        deterministic=False, rngs={"dropout": k_drop}, mutable=["intermediates"])
    z = nets.head.apply({"params": params["head"]}, out.last_hidden_state[:, 0])
    z1, z2 = jnp.split(z.astype(jnp.float32), 2)
    loss, metrics = info_nce_loss(z1, z2, queue, queue_valid, temperature=config.loss.temperature,
                                  anchor_ids=batch[SENTENCE_IDS_KEY], queue_ids=queue_ids,
                                  mask_same_sentence=config.momentum.mask_same_sentence)
    metrics = dict(metrics, infonce=loss)
    if use_ami:
      att1, att2 = jnp.split(collect_attentions(state["intermediates"], nets.ami_layers), 2, axis=1)
      l_d, ami_metrics = ami_loss(att1, att2, batch["attention_mask"], k_ami, weight=a.weight,
                                  num_samples=a.num_samples, heads_per_slice=a.heads_per_slice,
                                  pool_layers=a.pool_layers, require_positive=a.require_positive)
      loss = loss + l_d
      metrics.update(ami_metrics)
    return loss, metrics

  def momentum_embeddings(state: TrainState, batch, key):
    """Momentum encoder (dropout p_m) + the online MLP head; no gradient flows here."""
    out = nets.momentum.apply({"params": state.ema_params}, batch["input_ids"], batch["attention_mask"],
                              batch["token_type_ids"], deterministic=False, rngs={"dropout": key})
    z = nets.head.apply({"params": state.params["head"]}, out.last_hidden_state[:, 0])
    return jax.lax.stop_gradient(l2_normalize(z.astype(jnp.float32)))

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    k_drop, k_mom, k_ami = jax.random.split(jax.random.fold_in(state.rng, state.step), 3)
    queue = state.queue if use_momentum else None
    valid = state.queue_valid if use_momentum else None
    queue_ids = state.queue_ids if use_momentum else None
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, batch, queue, valid, queue_ids, k_drop, k_ami)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    if use_momentum:
      keys = momentum_embeddings(state, batch, k_mom)
      q, v, ptr = enqueue(state.queue, state.queue_valid, state.queue_ptr, keys)
      new = new.replace(ema_params=ema_update(params["encoder"], state.ema_params, config.momentum.decay),
                        queue=q, queue_valid=v, queue_ptr=ptr,
                        queue_ids=enqueue_ids(state.queue_ids, state.queue_ptr, batch[SENTENCE_IDS_KEY]))
    metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads), lr=schedule(state.step))
    return new, metrics

  return train_step
