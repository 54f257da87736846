"""The one update step: two views → loss terms picked by config → enqueue → the fused update (AdamW, EMA, copies).

miCSE total loss L = L_C + L_D (paper §2): L_C is InfoNCE over the MLP-pooled [CLS] of two
dropout views with in-batch and queue negatives (Eq. 2); L_D = −λ·AMI between the views'
attention maps (Eq. 3–5). The relatives are the same step with other named parts
(`augmentation/training_views.py`, `training/terms.py`): the second view (dropout, Attention-Driven
Dropout, Mirror-BERT span masking), the encoding (one encoder, or CT's two), the contrastive
term (InfoNCE or positive-only) and the extra terms (AMI, InforMin-CL reconstruction, MLM,
InfoCSE's auxiliary MLM network). One jitted, donated step for all of them (`training/program.py`).
With `chunk_size`, the loss and its gradient are computed in blocks of rows (GradCache,
`training/grad_cache.py`, `gradient_function`): the same values in the memory of one block.

Per-member hyper-parameters (a population's `configs/population_fields.PER_MEMBER` step inputs) come as
an explicit argument `hyper` of arrays, in place of the config's constant; a solo run passes
none, so its program holds the constants. How the step reads each:
  `ami_weight`     λ of the AMI term, for `ami.weight`;
  `learning_rate`  the schedule's peak: the optimizer runs at peak 1 (`program.step_config`) and
                   the update (and the logged `lr`) is scaled by it.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from micse_jax.augmentation.training_views import SECOND_VIEWS, encode_views, tokens_of
from micse_jax.data.pipeline import ROW_MASK_KEY, SENTENCE_IDS_KEY
from micse_jax.training import (
  data_parallel,
  grad_cache,
  infocse,
  non_finite,
  optim,
  precision,
  state_placement,
  terms,
  update,
  weight_copies,
)
from micse_jax.training.momentum import Queue, momentum_embeddings
from micse_jax.training.networks import Networks
from micse_jax.training.state import TrainState

KEY_NAMES = ("drop", "momentum", "ami", "view", "mlm", "infocse")


def step_keys(rng: jax.Array, step) -> dict[str, jax.Array]:
  """One independent key per random part of the step (`KEY_NAMES`): the base key `rng` folded
  with the step number, then split."""
  return dict(zip(KEY_NAMES, jax.random.split(jax.random.fold_in(rng, step), len(KEY_NAMES))))


def make_loss_fn(config: ml_collections.ConfigDict, nets: Networks, mesh: Mesh | None = None) -> Callable:
  """loss_fn(params, frozen, batch, queue, keys, step, hyper=None) -> (loss, metrics).

  `queue` is the momentum `Queue` of extra negatives, or None (no momentum encoder). On a
  data-parallel `mesh` the per-sentence AMI sampling runs on the device holding the sentence
  (`data_parallel.rows_per_device`). Rows with `batch["row_mask"]` 0 (padding of a batch the devices do
  not divide) are no anchor, no negative and in no term or metric.
  """
  second_view, encode = SECOND_VIEWS[config.view.kind], encode_views(config)
  map_rows = data_parallel.rows_per_device(mesh)
  head_b = "head_b" if config.ct.enabled else "head"

  def project(params, head_name, hidden):
    return nets.head.apply({"params": params[head_name]}, hidden[:, 0]).astype(jnp.float32)

  def loss_fn(params, frozen, batch, queue: Queue | None, keys, step, hyper=None):
    with jax.named_scope("views"):
      view2 = second_view(params, batch, keys["view"], nets, config)
    with jax.named_scope("encode"):
      enc = encode(params, tokens_of(batch), view2, keys["drop"], nets)
      z1, z2 = project(params, "head", enc.hidden1), project(params, head_b, enc.hidden2)
    row_mask = batch.get(ROW_MASK_KEY)
    with jax.named_scope("loss/contrastive"):
      parts = [terms.contrastive_term(z1, z2, queue, config, anchor_ids=batch.get(SENTENCE_IDS_KEY),
                                      row_mask=row_mask)]
    if config.ami.enabled:
      with jax.named_scope("loss/ami"):
        parts.append(terms.ami_term(enc.att1, enc.att2, batch["attention_mask"], keys["ami"], config,
                                    row_mask=row_mask, map_rows=map_rows, weight=(hyper or {}).get("ami_weight")))
    if config.reconstruction.enabled:
      with jax.named_scope("loss/reconstruction"):
        parts.append(terms.reconstruction_term(z1, z2, config, row_mask=row_mask))
    if config.mlm.enabled:
      with jax.named_scope("loss/mlm"):
        parts.append(terms.mlm_term(params, batch, keys["mlm"], nets, config))
    loss = sum(p[0] for p in parts)
    metrics = {k: v for _, m in parts for k, v in m.items()}
    if config.infocse.enabled:  # its term, and its pre-training phase (§3.1)
      with jax.named_scope("loss/infocse"):
        loss, metrics = infocse.add_to_loss(loss, metrics, params, frozen, batch, enc.hidden1[:, 0],
                                            keys["infocse"], step, nets, config)
    return loss, metrics

  return loss_fn


def gradient_function(config, nets: Networks, loss_fn: Callable, copies: dict, loss_scale: dict, blocks: int,
                      devices: int, map_rows: Callable) -> Callable:
  """(params, frozen, batch, queue, keys, step, hyper) -> ((loss, metrics), gradient), the forward reading
  the half-precision `copies`: the whole batch at once, or in `blocks` blocks of rows per device (GradCache,
  `training/grad_cache.py`: the same loss and gradient, in the memory of one block)."""
  read = lambda params: weight_copies.read_through(params, copies)
  if blocks > 1:
    return grad_cache.value_and_unscaled_grad(config, nets, read, loss_scale, blocks, devices, map_rows)
  return precision.value_and_unscaled_grad(lambda params, *args: loss_fn(read(params), *args), loss_scale,
                                           config.model.loss_scale_period)


def make_train_step(config: ml_collections.ConfigDict, nets: Networks, schedule: Callable[[Any], Any],
                    mesh: Mesh | None = None) -> Callable[..., tuple[TrainState, dict]]:
  """Returns the pure (un-jitted) step (state, batch, hyper=None, alive=None) → (state, metrics);
  `program` jits it with shardings and donation (and passes its `mesh`, see `make_loss_fn`).

  The update is one fused pass (`training/update.apply`: clipping + AdamW on `schedule`, the EMA, the
  half-precision copies). `alive` (a population member's flag, traced) makes it a member's update.
  Which updates are skipped, and what a skipped step keeps, is the non-finite policy's
  (`training/non_finite.py`): a member's while it is stopped or its loss or gradient norm is not finite,
  a solo run's only a float16 step the loss scale skips."""
  loss_fn = make_loss_fn(config, nets, mesh)
  map_rows = data_parallel.rows_per_device(mesh)
  mesh_config = config.get("mesh", {})
  sharded = mesh_config.get("shard_state", False)
  whole = lambda tree: state_placement.gathered_for_compute(tree, mesh, sharded)  # FSDP: gather where used
  split = lambda tree: state_placement.split_for_update(
      tree, mesh, mesh_config.get("shard_update", False) and not sharded,
      mesh_config.get("shard_min_elements", state_placement.MIN_SHARDED_ELEMENTS))
  inner, max_norm = optim.adamw(config, schedule), optim.clip_norm(config)
  devices = 1 if mesh is None else mesh.size  # the devices a step's rows are split over

  def train_step(state: TrainState, batch: dict, hyper: dict | None = None,
                 alive: jax.Array | None = None) -> tuple[TrainState, dict]:
    hyper = hyper or {}
    keys = step_keys(state.rng, state.step)
    queue = None if state.queue is None else state.queue.replace(embeddings=whole(state.queue.embeddings))
    copies = whole(state.compute_weights)  # half precision: the kernels cast once per update, not per forward

    blocks = grad_cache.blocks_per_device(config, batch["input_ids"].shape[0], devices)  # `chunk_size`
    grad_fn = gradient_function(config, nets, loss_fn, copies, state.loss_scale, blocks, devices, map_rows)
    (loss, metrics), grads = grad_fn(whole(state.params), whole(state.frozen_params), batch, queue, keys,
                                     state.step, hyper)
    new = state.replace(step=state.step + 1)
    if state.queue is not None:
      with jax.named_scope("momentum_forward"):
        ema_params = weight_copies.substituted(whole(state.ema_params), copies.get(weight_copies.EMA))
        head = whole(state.params["head"])
        embeddings = (grad_cache.momentum_embeddings(nets, ema_params, head, batch, keys["momentum"], blocks, devices)
                      if blocks > 1 else momentum_embeddings(nets, ema_params, head, batch, keys["momentum"]))
      with jax.named_scope("enqueue"):  # padding rows are never enqueued
        new = new.replace(queue=state.queue.push(embeddings, batch[SENTENCE_IDS_KEY], batch.get(ROW_MASK_KEY)))
    mask = non_finite.update_mask(alive, loss, loss_scaling=bool(state.loss_scale))  # which updates are skipped
    with jax.named_scope("optimizer"):  # clipping + AdamW + EMA + copies in one pass (training/update.py)
      result = update.apply(update.Inputs(
          inner=inner, grads=split(grads), params=split(state.params), opt_state=state.opt_state, max_norm=max_norm,
          ema_params=split(state.ema_params), ema_decay=config.momentum.decay if state.queue is not None else None,
          copies=state.compute_weights, scale=hyper.get("learning_rate"), **mask))
    new = new.replace(params=result.params, opt_state=result.opt_state, ema_params=result.ema_params,
                      compute_weights=result.copies)
    with jax.named_scope("finite"):
      new, precision_metrics = non_finite.loss_scaled_step(jnp.isfinite(result.grad_norm), new, state,
                                                       config.model.loss_scale_period)
    lr = schedule(state.step) * hyper["learning_rate"] if "learning_rate" in hyper else schedule(state.step)
    metrics = dict(metrics, **precision_metrics, loss=loss, grad_norm=result.grad_norm, lr=lr)
    return new, metrics

  return train_step

