"""The loss terms of the one train step; each returns `(weighted loss, metrics)`.

| term | paper | function |
| --- | --- | --- |
| InfoNCE with optional queue negatives | miCSE Eq. 2 (SimCSE Eq. 1) | `contrastive_term` |
| positive-only alignment, no negatives | miCSE App. E / Tab. 4 | `contrastive_term` |
| attention mutual information, -λ·AMI | miCSE Eq. 3-5 | `ami_term` |
| InforMin-CL reconstruction λ·E‖z¹−z²‖² | InforMin-CL Eq. 8-9 | `reconstruction_term` |
| MLM auxiliary β·L_MLM on a masked copy | SimCSE App. (do_mlm) | `mlm_term` |
| InfoCSE auxiliary MLM network λ·L_MLM | InfoCSE §3.1, Eq. 5 | `training/infocse.py`: `infocse_term` |

The pure formulas live in `micse_jax/losses/`; this file wires them to the networks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from micse_jax.augmentation import mlm_mask
from micse_jax.augmentation.training_views import special_mask
from micse_jax.data.pipeline import ROW_MASK_KEY
from micse_jax.losses.alignment import positive_only_loss
from micse_jax.losses.ami import ami_loss
from micse_jax.losses.ami_cells import all_rows_here
from micse_jax.losses.ami_official import official_ami_loss
from micse_jax.losses.infonce import info_nce_loss, l2_normalize, row_mean
from micse_jax.losses.mlm import mlm_loss
from micse_jax.losses.reconstruction import reconstruction_loss
from micse_jax.training.momentum import Queue


def contrastive_term(z1, z2, queue: Queue | None, config, anchor_ids=None, row_mask=None):
  """InfoNCE (in-batch + `queue` negatives, none when it is None; queue entries of the anchor's
  own sentence, by `anchor_ids`, masked when `momentum.mask_same_sentence`), or the positive-only
  alignment objective. Rows with `row_mask` 0 (padding) are no anchor and no negative."""
  if config.loss.objective == "positive_only":
    loss = positive_only_loss(z1, z2, temperature=config.loss.temperature, row_mask=row_mask)
    pos_cos = row_mean(jnp.sum(l2_normalize(z1) * l2_normalize(z2), axis=-1), row_mask)
    return loss, {"positive_only": loss, "pos_cos": pos_cos}
  negatives = {} if queue is None else {"queue": queue.embeddings, "queue_valid": queue.valid,
                                         "queue_ids": queue.ids}
  loss, metrics = info_nce_loss(z1, z2, **negatives, temperature=config.loss.temperature, anchor_ids=anchor_ids,
                                mask_same_sentence=config.momentum.mask_same_sentence, row_mask=row_mask)
  return loss, dict(metrics, infonce=loss)


def ami_term(att1, att2, attention_mask, key, config, row_mask=None, map_rows=all_rows_here, weight=None,
             row_ids=None, totals=None, selection=None, samples=None):
  """-λ·AMI between the views' attention (miCSE Eq. 5); `ami.variant` picks paper/official.
  Each sentence is sampled where `map_rows` puts it (per device on a mesh); padding rows
  (`row_mask` 0) are left out. λ is `ami.weight`, or `weight` (a member's, traced) when given.
  For a block of a batch's rows (`training/grad_cache.py`): the rows' indices in the batch `row_ids`,
  the batch's denominators `totals` and (official) its `selection` at the block's rows, or (paper) the
  cells the first pass drew, `samples`; the term is then the block's share."""
  a = config.ami
  weight = a.weight if weight is None else weight
  if a.variant == "official":
    return official_ami_loss(att1, att2, key, weight=weight, num_samples=a.num_samples,
                             row_mask=row_mask, map_rows=map_rows, selection=selection, totals=totals)
  return ami_loss(att1, att2, attention_mask, key, weight=weight, row_mask=row_mask, map_rows=map_rows,
                  row_ids=row_ids, totals=totals, samples=samples, **paper_ami_options(config))


def paper_ami_options(config) -> dict:
  """The paper variant's sampling of the config's `ami` (`losses/ami.attention_mutual_information`)."""
  a = config.ami
  return {"num_samples": a.num_samples, "heads_per_slice": a.heads_per_slice, "pool_layers": a.pool_layers,
          "require_positive": a.require_positive}


def reconstruction_term(z1, z2, config, row_mask=None):
  """InforMin-CL: λ·L_R with L_R = E‖z¹ − z²‖² (Eq. 8-9); `normalize` = the public code's form."""
  r = config.reconstruction
  l_r = reconstruction_loss(z1, z2, normalize=r.normalize, row_mask=row_mask)
  return r.weight * l_r, {"reconstruction": l_r}


def masked_copy(batch, key, nets, prob):
  """(masked ids, labels, weights) of an MLM copy; padding rows (`row_mask` 0) get weight 0."""
  t = nets.tokens
  ids, labels, weights = mlm_mask(key, batch["input_ids"], batch["attention_mask"], special_mask(batch, nets),
                                  vocab_size=t.vocab_size, mask_token_id=t.mask_id, prob=prob)
  if ROW_MASK_KEY in batch:
    weights = weights * batch[ROW_MASK_KEY].astype(weights.dtype)[:, None]
  return ids, labels, weights


def mlm_term(params, batch, key, nets, config, copy=None, total=None):
  """SimCSE's `do_mlm`: β·MLM loss of the online encoder + BERT MLM head on a masked *copy*.

  For a block of a batch's rows (`models/row_block.py`), `copy` is the batch's masked copy (`masked_copy`
  with the first of `key`'s two halves) at the block's rows and `total` its Σ weights: the term is the
  block's share of the batch's."""
  k_mask, k_drop = jax.random.split(key)
  masked_ids, labels, weights = copy if copy is not None else masked_copy(batch, k_mask, nets, config.mlm.prob)
  variables = {"params": {**params["encoder"], "cls": params["mlm_head"]}}
  out = nets.with_mlm_head.apply(variables, masked_ids, batch["attention_mask"], batch["token_type_ids"],
                                 deterministic=False, rngs={"dropout": k_drop})
  loss = mlm_loss(out.mlm_logits, labels, weights, total)
  return config.mlm.weight * loss, {"mlm": loss}
