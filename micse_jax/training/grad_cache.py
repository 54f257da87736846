"""GradCache: the train step's loss and gradient over a batch taken in blocks of rows (`chunk_size`),
in the memory of one block, equal to the whole batch's step to float rounding.

Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup" (GradCache,
Alg. 1): the contrastive terms couple a batch's rows only through their embeddings z = (z¹, z²), so

    ∂L/∂θ = Σ_rows (∂L/∂z_row) · (∂z_row/∂θ),

and the step runs in three passes (`value_and_unscaled_grad`):

1. every block's forward, both views, without keeping activations: z, and the counts the
   per-sentence terms divide by, with the cells AMI draws (`_counts`);
2. the terms of z alone on the whole batch — InfoNCE with in-batch and queue negatives (or the
   positive-only alignment) and InforMin-CL's reconstruction, global across devices as in the
   unblocked step — and their gradient g = ∂L/∂z;
3. every block's forward again, now differentiated: the pull-back of ⟨g_block, z_block⟩, plus the
   block's share of the per-sentence terms (AMI on its own attention maps, SimCSE's MLM, InfoCSE's
   auxiliary network), the blocks' gradients added up (each block's backward adds the sum so far,
   `_carried`).

The last block is the exception: pass 1 runs its forward keeping what its backward needs (`jax.vjp`),
and pass 3 starts with that block's backward (`_replayed`), so its forward runs once. Its activations
are held through pass 2, so the peak rises only where pass 2's whole-batch terms are large against a
block.

The per-sentence terms are sums over rows divided by batch-wide counts that carry no gradient (Σ of
AMI's pair weights and the official variant's kept slices, the masked tokens): pass 1 collects them,
and a block's term is its rows' sum over the batch's count, the shares adding up to the term
(`losses/ami.Totals`, `mlm_loss(total=...)`).

Every random draw is the whole batch's at the block's rows, in both forward passes: the dropout masks
(`models/row_block.py`, read by the dropout sites and the dropout-attention kernels), AMI's samples
(keyed by the row's index in the batch), and the draws over token batches — SimCSE's MLM and InfoCSE's
masking, Mirror-BERT's span — made once over the whole batch and cut to the block. Attention-Driven
Dropout's view runs the encoder, so it is made per block (a deterministic forward, the same in both
passes). On a data-parallel mesh each device's rows are cut into blocks of its own (`row_block.Block`):
no row moves, and the negatives stay global. The momentum encoder's forward runs by blocks too
(`momentum_embeddings`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections

from micse_jax.augmentation.training_views import SECOND_VIEWS, encode_views, tokens_of
from micse_jax.data.pipeline import ROW_MASK_KEY, SENTENCE_IDS_KEY
from micse_jax.losses.ami import Totals, attention_mutual_information
from micse_jax.losses.ami_official import official_cells, official_selection
from micse_jax.models import row_block
from micse_jax.training import infocse, precision, terms
from micse_jax.training import momentum as momentum_queue
from micse_jax.training.networks import Networks

OFF = "0"                # `chunk_size` of the unblocked step
VIEWS_BY_BLOCK = ("add",)  # second views that run the encoder: made per block, not over the whole batch


def chunk_rows(value) -> int:
  """`chunk_size` as rows per block (0: the whole batch); "auto" must have been resolved before."""
  text = str(value).strip()
  if not text.isdigit():
    raise ValueError(f"chunk_size must be resolved to an integer before the step is built, got {value!r}")
  return int(text)


def blocks_per_device(config: ml_collections.ConfigDict, rows: int, devices: int) -> int:
  """How many blocks each device cuts its rows into: the step's `rows` (the padded global batch) over
  `chunk_size` (global rows per block, a multiple of `devices`); 1 when `chunk_size` is 0 or the batch."""
  size = chunk_rows(config.get("chunk_size", OFF))
  if size == 0 or size == rows:
    return 1
  if rows % size or size % devices:
    raise ValueError(f"chunk_size={size} must divide the batch of {rows} rows and be a multiple of the "
                     f"{devices} devices")
  return rows // size


def by_blocks(fn: Callable, count: int, devices: int):
  """`fn(block)` for each of the `count` blocks per device (`row_block.Block`), one loop iteration each,
  its outputs (arrays over the block's rows) put back in the whole batch's row order."""
  return _in_row_order(_stacked(fn, count, count, devices), devices)


def _stacked(fn: Callable, trips: int, count: int, devices: int):
  """`fn(block)` for the first `trips` of the `count` blocks per device, stacked `[trips, rows, ...]`."""
  def body(carry, index):
    return carry, fn(row_block.Block(index, count, devices))
  _, stacked = jax.lax.scan(body, None, jnp.arange(trips, dtype=jnp.int32))
  return stacked


def _in_row_order(stacked, devices: int):
  return jax.tree.map(lambda x: row_block.whole_of(x, devices), stacked)


def momentum_embeddings(nets: Networks, ema_params, head_params, batch: dict, key, count: int, devices: int):
  """`momentum.momentum_embeddings` of the whole batch, by blocks of rows (the same dropout masks)."""
  def block_embeddings(block):
    with row_block.applied(block):
      return momentum_queue.momentum_embeddings(nets, ema_params, head_params, row_block.of_tree(block, batch), key)
  return by_blocks(block_embeddings, count, devices)


def value_and_unscaled_grad(config: ml_collections.ConfigDict, nets: Networks, read: Callable, loss_scale: dict,
                            count: int, devices: int, map_rows: Callable) -> Callable:
  """The blocked counterpart of `precision.value_and_unscaled_grad(loss_fn, loss_scale, ...)` on the
  step's `loss_fn` (`training/step.make_loss_fn`): a function (params, frozen, batch, queue, keys, step,
  hyper) -> ((loss, metrics), ∂loss/∂params), computed in `count` blocks per device (module
  docstring). `read(params)` gives the weights the forward reads (`weight_copies.read_through`)."""
  def run(params, frozen, batch, queue, keys, step, hyper=None):
    blocks = _Blocks(config=config, nets=nets, read=read, count=count, devices=devices, map_rows=map_rows,
                     batch=batch, keys=keys, frozen=frozen, hyper=hyper or {})
    blocks = dataclasses.replace(blocks, whole_view2=blocks.whole_second_view(params))
    last = row_block.Block(jnp.int32(count - 1), count, devices)
    with jax.named_scope("embed_blocks"):  # pass 1: no activations kept, but the last block's
      stacked = _stacked(lambda block: blocks.embed(params, block), count - 1, count, devices)
      # the kept forward after the other blocks' forwards, so that their memory is never held together
      # (XLA inlines a loop of one trip, and could otherwise interleave them)
      stacked, after = jax.lax.optimization_barrier((stacked, params))
      last_embedded, kept = blocks.embed_kept(after, last)
    z1, z2, counts = _in_row_order(jax.tree.map(lambda s, x: jnp.concatenate([s, x[None]]), stacked, last_embedded),
                                   devices)
    ami = _ami_totals(counts, batch.get(ROW_MASK_KEY), config, _official_cells_per_slice(nets, blocks.length))
    with jax.named_scope("loss/contrastive"):  # pass 2: the terms of z on the whole batch, and ∂L/∂z
      (loss, metrics), dz = jax.value_and_grad(blocks.batch_terms, argnums=(0, 1), has_aux=True)(z1, z2, queue)
    pretraining = (step < config.infocse.pretrain_steps) if config.infocse.enabled else jnp.asarray(False)
    pulled = _Pulled(dz=dz, ami=ami, copies=_masked_copies(batch, keys, nets, config), pretraining=pretraining)

    def objective(p, block, so_far):
      value, aux = blocks.objective(p, block, pulled)
      return value + _carried(p, so_far), aux
    period = config.model.loss_scale_period
    block_grad = precision.value_and_unscaled_grad(objective, loss_scale, period)
    kept_grad = precision.value_and_unscaled_grad(lambda p: blocks.objective(p, last, pulled, kept), loss_scale,
                                                  period)

    (_, last_aux), last_grads = kept_grad(params)  # the last block first: its forward was kept in pass 1
    # the other blocks' forwards after its backward, for the same reason
    last_grads, after = jax.lax.optimization_barrier((last_grads, params))

    def backprop(total, index):  # pass 3: each block's gradient, added up
      so_far, aux_so_far = total
      (_, aux), grads = block_grad(after, row_block.Block(index, count, devices), so_far)
      return (grads, jax.tree.map(jnp.add, aux_so_far, aux)), None
    (grads, (extra, shares)), _ = jax.lax.scan(backprop, (last_grads, last_aux),
                                               jnp.arange(count - 1, dtype=jnp.int32))
    metrics = {**metrics, **shares, **_batch_constants(config, ami[1])}
    loss = loss + extra
    if config.infocse.enabled:  # the pre-training phase's loss is InfoCSE's term alone (`infocse.add_to_loss`)
      loss = jnp.where(pretraining, shares["infocse_mlm"], loss)
    return (loss, metrics), grads

  return run


@jax.custom_vjp
def _replayed(params, outputs, pull_back):
  """`outputs`, a forward's results on `params` already computed, differentiated by that forward's
  `pull_back` (`jax.vjp`): a block's backward in pass 3 without running its forward again."""
  del params, pull_back
  return outputs


def _replayed_forward(params, outputs, pull_back):
  del params
  return outputs, pull_back


def _replayed_backward(pull_back, cotangent):
  return pull_back(cotangent)[0], None, None


_replayed.defvjp(_replayed_forward, _replayed_backward)


@dataclasses.dataclass(frozen=True)
class _Kept:
  """Pass 1's forward of the last block, kept for its backward: its rows, the forward's outputs (the
  `Encoded` views, z¹, z²) and their pull-back to the parameters."""
  rows: dict
  outputs: tuple
  pull_back: Callable


def _carried(params, so_far):
  """Σ ⟨so_far, θ⟩ over the leaves, with no gradient into `so_far`: its gradient is `so_far`, so a block's
  gradient comes out with the blocks' before it added where autodiff sums each weight's gradient (XLA
  may fold it into the kernel that writes the weight's gradient) instead of in a pass of its own."""
  terms_ = [jnp.vdot(jax.lax.stop_gradient(s).astype(jnp.float32), p.astype(jnp.float32))
            for s, p in zip(jax.tree.leaves(so_far), jax.tree.leaves(params))]
  return sum(terms_, jnp.zeros((), jnp.float32))


@dataclasses.dataclass(frozen=True)
class _Pulled:
  """What pass 3 reads of passes 1 and 2: ∂L/∂(z¹, z²) of the whole batch, AMI's batch counts (`Totals`,
  the official selection), the masked copies with their Σ weights, InfoCSE's pre-training flag."""
  dz: tuple
  ami: tuple
  copies: dict
  pretraining: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Blocks:
  """One blocked step's inputs, and the passes over its blocks."""
  config: ml_collections.ConfigDict
  nets: Networks
  read: Callable
  count: int
  devices: int
  map_rows: Callable
  batch: dict
  keys: dict
  frozen: Any
  hyper: dict
  whole_view2: dict | None = None  # the second view drawn over the whole batch, unless it runs the encoder

  @property
  def length(self) -> int:
    return self.batch["input_ids"].shape[1]

  def whole_second_view(self, params) -> dict | None:
    """The second view of the whole batch (its draws are the batch's), or None for a view made per block."""
    if self.config.view.kind in VIEWS_BY_BLOCK:
      return None
    return SECOND_VIEWS[self.config.view.kind](self.read(params), self.batch, self.keys["view"], self.nets,
                                               self.config)

  def forward(self, weights, block: row_block.Block):
    """The block's rows, their encoding and embeddings (z¹, z²), its draws the batch's at its rows."""
    c, rows = self.config, row_block.of_tree(block, self.batch)
    with row_block.applied(block):
      with jax.named_scope("views"):
        view2 = (SECOND_VIEWS[c.view.kind](weights, rows, self.keys["view"], self.nets, c)
                 if self.whole_view2 is None else row_block.of_tree(block, self.whole_view2))
      with jax.named_scope("encode"):
        enc = encode_views(c)(weights, tokens_of(rows), view2, self.keys["drop"], self.nets)
        project = lambda name, hidden: self.nets.head.apply({"params": weights[name]}, hidden[:, 0]).astype(jnp.float32)
        return rows, enc, project("head", enc.hidden1), project("head_b" if c.ct.enabled else "head", enc.hidden2)

  def embed(self, params, block: row_block.Block):
    """Pass 1 on a block: its (z¹, z²) and the counts the per-sentence terms divide by."""
    rows, enc, z1, z2 = self.forward(self.read(params), block)
    return z1, z2, self.counts(enc, rows, block)

  def embed_kept(self, params, block: row_block.Block):
    """Pass 1 on a block, keeping its forward for pass 3: `embed`'s results and the `_Kept` forward."""
    def outputs(p):
      rows, enc, z1, z2 = self.forward(self.read(p), block)
      return (enc, z1, z2), rows
    (enc, z1, z2), pull_back, rows = jax.vjp(outputs, params, has_aux=True)
    return (z1, z2, self.counts(enc, rows, block)), _Kept(rows, (enc, z1, z2), pull_back)

  def counts(self, enc, rows, block: row_block.Block) -> dict:
    """`_counts` of a block's encoding, its AMI draws keyed by the rows' indices in the batch."""
    row_ids = _row_ids(block, rows)
    return _counts(enc, rows, self.keys["ami"], self.config, self.map_rows, row_ids)

  def batch_terms(self, z1, z2, queue):
    """The terms of the embeddings alone, on the whole batch (as `step.make_loss_fn` computes them)."""
    c, row_mask = self.config, self.batch.get(ROW_MASK_KEY)
    parts = [terms.contrastive_term(z1, z2, queue, c, anchor_ids=self.batch.get(SENTENCE_IDS_KEY), row_mask=row_mask)]
    if c.reconstruction.enabled:
      parts.append(terms.reconstruction_term(z1, z2, c, row_mask=row_mask))
    return sum(p[0] for p in parts), {k: v for _, m in parts for k, v in m.items()}

  def objective(self, params, block: row_block.Block, pulled: _Pulled, kept: _Kept | None = None):
    """Pass 3 on a block: ⟨∂L/∂z, z⟩ of its rows plus its shares of the per-sentence terms (InfoCSE's
    pre-training phase, §3.1: its term alone, as `infocse.add_to_loss`); (objective, (extra, shares)).
    The block's forward runs here, or was `kept` in pass 1."""
    c, weights = self.config, self.read(params)
    if kept is None:
      rows, enc, z1, z2 = self.forward(weights, block)
    else:
      rows, (enc, z1, z2) = kept.rows, _replayed(params, kept.outputs, kept.pull_back)
    objective = jnp.sum(block.of_whole(pulled.dz[0]) * z1) + jnp.sum(block.of_whole(pulled.dz[1]) * z2)
    parts = []
    if c.ami.enabled:
      with jax.named_scope("loss/ami"):
        parts.append(_ami_share(enc, rows, self.keys["ami"], c, self.map_rows, block, *pulled.ami,
                                self.hyper.get("ami_weight")))
    if c.mlm.enabled:
      copy, total = pulled.copies["mlm"]
      with jax.named_scope("loss/mlm"), row_block.applied(block):
        parts.append(terms.mlm_term(weights, rows, self.keys["mlm"], self.nets, c,
                                    copy=row_block.of_tree(block, copy), total=total))
    extra = sum((p[0] for p in parts), jnp.zeros((), jnp.float32))
    shares = {k: v for _, m in parts for k, v in m.items()}
    if not c.infocse.enabled:
      return objective + extra, (extra, shares)
    copy, total = pulled.copies["infocse"]
    cls = enc.hidden1[:, 0]
    with jax.named_scope("loss/infocse"), row_block.applied(block):
      term, term_metrics = infocse.infocse_term(
          weights, self.frozen, rows, jnp.where(pulled.pretraining, jax.lax.stop_gradient(cls), cls),
          self.keys["infocse"], self.nets, c, copy=row_block.of_tree(block, copy), total=total)
    objective = jnp.where(pulled.pretraining, term_metrics["infocse_mlm"], objective + extra + term)
    return objective, (extra + term, {**shares, **term_metrics})


def _counts(enc, rows, key, config, map_rows, row_ids):
  """What the AMI term divides by, from a block's attention maps: Σ of its pair weights (paper
  variant), or each slice's valid cells `[rows, S]` (official); {} without AMI."""
  if not config.ami.enabled:
    return {}
  if config.ami.variant == "official":
    valid, _, _ = official_cells(enc.att1, enc.att2)
    return {"num_valid": jnp.sum(valid, axis=-1).astype(jnp.int32)}
  res = attention_mutual_information(enc.att1, enc.att2, rows["attention_mask"], key, row_mask=rows.get(ROW_MASK_KEY),
                                     map_rows=map_rows, row_ids=row_ids, **terms.paper_ami_options(config))
  # per row, put back in the batch's order: the pairs that count, and the cells drawn (pass 3 takes them)
  return {"pairs": jnp.sum(res.weight, axis=-1), "indices": res.indices, "sample_weight": res.sample_weight}


def _row_ids(block: row_block.Block, rows: dict) -> jax.Array:
  """The indices in the whole batch of a block's `rows` (what AMI keys its draws by)."""
  return block.of_whole(jnp.arange(block.whole_rows(rows["input_ids"].shape[0]), dtype=jnp.int32))


def _ami_totals(counts: dict, row_mask, config, cells: int):
  """(the batch's AMI denominators `Totals`, the official variant's `OfficialSelection` or the paper
  variant's cells drawn in pass 1, (indices, sample_weight) `[B, S, m]`), or (None, None) without AMI."""
  if not config.ami.enabled:
    return None, None
  some = next(iter(counts.values()))
  rows = jnp.asarray(some.shape[0], jnp.float32) if row_mask is None else jnp.sum(row_mask.astype(jnp.float32))
  if config.ami.variant == "official":
    num_valid = counts["num_valid"]
    selection = official_selection(num_valid, row_mask, config.ami.num_samples, cells)
    return Totals(pairs=jnp.sum(selection.weight), rows=rows), selection
  return Totals(pairs=jnp.sum(counts["pairs"]), rows=rows), (counts["indices"], counts["sample_weight"])


def _official_cells_per_slice(nets: Networks, length: int) -> int:
  """C, the cells of an official slice (`official_cells`): the AMI layers of one parity, T² each."""
  return len(nets.ami_layers) // 2 * length * length


def _ami_share(enc, rows, key, config, map_rows, block, totals, drawn, weight):
  """The block's share of the AMI term and its metrics (`terms.ami_term` on the block's rows), from what
  pass 1 `drawn` (`_ami_totals`) at the block's rows."""
  row_ids = _row_ids(block, rows)
  selection = samples = None
  if config.ami.variant == "official":
    selection = drawn._replace(weight=block.of_whole(drawn.weight), num_valid=block.of_whole(drawn.num_valid),
                               row_ids=row_ids)
  else:
    samples = tuple(block.of_whole(x) for x in drawn)
  return terms.ami_term(enc.att1, enc.att2, rows["attention_mask"], key, config, row_mask=rows.get(ROW_MASK_KEY),
                        map_rows=map_rows, weight=weight, row_ids=row_ids, totals=totals, selection=selection,
                        samples=samples)


def _batch_constants(config, selection) -> dict:
  """The official AMI metrics that are the batch's, not sums over its rows (a block reports them whole)."""
  if not config.ami.enabled or config.ami.variant != "official":
    return {}
  return {"ami_samples": selection.num_used.astype(jnp.float32), "ami_scale": selection.scale}


def _masked_copies(batch, keys, nets, config) -> dict:
  """The MLM and InfoCSE masked copies of the whole batch (their draws are over the whole batch), each
  with its Σ weights."""
  out = {}
  for name, enabled, prob in (("mlm", config.mlm.enabled, config.mlm.get("prob")),
                              ("infocse", config.infocse.enabled, config.infocse.get("mask_prob"))):
    if enabled:
      copy = terms.masked_copy(batch, jax.random.split(keys[name])[0], nets, prob)
      out[name] = (copy, jnp.sum(copy[2]))
  return out
