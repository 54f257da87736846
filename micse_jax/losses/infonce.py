"""InfoNCE over two dropout views with optional queue negatives (miCSE Eq. 2).

The SimCSE unsupervised objective that miCSE keeps as its first term: for anchor
z1[i] the positive is z2[i] (the same sentence under a second dropout mask), the
negatives are the other sentences' second views z2[j != i] and, optionally, the
entries of a negative queue filled by a momentum encoder. Logits are cosine
similarities divided by the temperature tau; the loss is the mean cross-entropy
of each row with label i.

Same-sentence masking (a departure from the paper, on by default). The queue keeps keys
for Q/B steps; on a few-shot subset of n sentences each sentence returns every n/B steps,
so when n is near or below Q the queue routinely holds the anchor's *own* sentence
(encoded by the momentum encoder) and the paper's loss pushes the anchor away from
itself (on the paper's full corpus that almost never happens). Given the sentence ids of
anchors and queue entries, those entries are masked exactly like empty slots (`mask_same_sentence=True`, config
`momentum.mask_same_sentence`). With `mask_same_sentence=False` the loss is the paper's
Eq. 2 unchanged; on large corpora the two coincide almost everywhere.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

# Logit given to queue slots that hold no embedding yet. exp(_MASKED - max) is an
# exact 0 in float32 because real logits are bounded by 1 / temperature.
_MASKED_LOGIT = -1e9
_NORM_EPS = 1e-8


def _compute_dtype(x: jax.Array) -> jnp.dtype:
  """float32, or wider when the input already is (float64 in tests)."""
  return jnp.promote_types(x.dtype, jnp.float32)


def l2_normalize(x: jax.Array, eps: float = _NORM_EPS) -> jax.Array:
  """Scales the rows of `x` to unit norm; an all-zero row stays zero (no NaN)."""
  sq_norm = jnp.sum(jnp.square(x), axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(sq_norm, eps * eps))


def same_sentence(anchor_ids: jax.Array, queue_ids: jax.Array) -> jax.Array:
  """`[B, Q]` bool: queue slot k holds anchor i's sentence (ids equal; -1 marks an empty slot)."""
  return (queue_ids[None, :] == anchor_ids[:, None]) & (queue_ids[None, :] >= 0)


def _queue_logits(z1n: jax.Array, queue: jax.Array, queue_valid: Optional[jax.Array],
                  temperature: float, dropped: Optional[jax.Array]) -> jax.Array:
  """cos(z1_i, q_k) / tau as extra columns; unfilled slots (and `dropped` [B, Q] pairs)
  get a huge negative logit.

  Invalid rows are zeroed *before* the matmul, so garbage there (even NaN or inf)
  reaches neither the loss nor any gradient.
  """
  queue = queue.astype(_compute_dtype(z1n))
  if queue_valid is not None:
    valid = queue_valid.astype(bool)
    queue = jnp.where(valid[:, None], queue, 0.0)
  logits = z1n @ l2_normalize(queue).T / temperature
  if queue_valid is not None:
    logits = jnp.where(valid[None, :], logits, _MASKED_LOGIT)
  if dropped is not None:
    logits = jnp.where(dropped, _MASKED_LOGIT, logits)
  return logits


def row_mean(x: jax.Array, row_mask: Optional[jax.Array]) -> jax.Array:
  """Mean of `x` (`[B, ...]`) over the real rows: all rows when `row_mask` is None, else the
  rows with `row_mask` 1 (padding rows of a padded batch are left out)."""
  if row_mask is None:
    return jnp.mean(x)
  rows = jnp.broadcast_to(row_mask.astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1)), x.shape)
  return jnp.sum(rows * x) / jnp.maximum(jnp.sum(rows), 1.0)


def _queue_metrics(queue_valid: Optional[jax.Array], self_pairs: Optional[jax.Array],
                   dropped: Optional[jax.Array], shape: tuple[int, int],
                   row_mask: Optional[jax.Array]) -> dict[str, jax.Array]:
  """Fractions of the B x Q (anchor, slot) pairs of real anchors: masked (empty or dropped),
  own sentence."""
  empty = (jnp.zeros(shape, bool) if queue_valid is None
           else jnp.broadcast_to(~queue_valid.astype(bool)[None, :], shape))
  masked = empty if dropped is None else empty | dropped
  metrics = {'queue_masked_frac': row_mean(masked.astype(jnp.float32), row_mask)}
  if self_pairs is not None:
    metrics['queue_self_frac'] = row_mean((self_pairs & ~empty).astype(jnp.float32), row_mask)
  return metrics


def diagonal(x: jax.Array) -> jax.Array:
  """x[i, i] of a `[B, C]` array (C >= B) as each row's sum over a mask of its own column: the same
  values, and on a row-split mesh each device keeps its rows' diagonal (an iota mask) where
  `jnp.diagonal` / `take_along_axis` at global indices make XLA gather it."""
  own = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) == jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.sum(jnp.where(own, x, jnp.zeros((), x.dtype)), axis=1)


def _in_batch_metrics(cos: jax.Array, logits: jax.Array, row_mask: Optional[jax.Array]):
  """pos_cos, neg_cos (over ordered pairs of distinct real rows) and acc, over real anchors."""
  batch = cos.shape[0]
  labels = jnp.arange(batch)
  pos_cos = diagonal(cos)
  acc = (jnp.argmax(logits, axis=1) == labels).astype(jnp.float32)
  if row_mask is None:
    neg_sum, pairs = jnp.sum(cos) - jnp.sum(pos_cos), max(batch * (batch - 1), 1)
  else:
    real = row_mask.astype(cos.dtype)
    n = jnp.sum(real)
    neg_sum = real @ cos @ real - jnp.sum(real * pos_cos)
    pairs = jnp.maximum(n * (n - 1), 1.0)
  return {'pos_cos': row_mean(pos_cos, row_mask), 'neg_cos': neg_sum / pairs,
          'acc': row_mean(acc, row_mask)}


def info_nce_loss(z1: jax.Array, z2: jax.Array, queue: Optional[jax.Array] = None,
                  queue_valid: Optional[jax.Array] = None,
                  temperature: float = 0.05, anchor_ids: Optional[jax.Array] = None,
                  queue_ids: Optional[jax.Array] = None,
                  mask_same_sentence: bool = True,
                  row_mask: Optional[jax.Array] = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """SimCSE / miCSE InfoNCE loss (miCSE Eq. 2), optionally with queue negatives.

  loss = -1/B sum_i log( exp(s(z1_i, z2_i)/tau) /
                         (sum_j exp(s(z1_i, z2_j)/tau) + sum_k exp(s(z1_i, q_k)/tau)) ),
  with s the cosine similarity. Computed in float32 (or wider) whatever the input dtype.
  With ids and `mask_same_sentence`, the sum over k skips every q_k of anchor i's own
  sentence (see the module docstring: off reproduces the paper).

  Args:
    z1: `[B, D]` embeddings of the first dropout view (anchors).
    z2: `[B, D]` embeddings of the second view; z2[i] is the positive of z1[i].
    queue: optional `[Q, D]` extra negatives (e.g. momentum-encoder embeddings).
    queue_valid: optional `[Q]` bool, False for slots not filled yet; those slots
      contribute nothing. None means every queue slot is valid.
    temperature: softmax temperature tau.
    anchor_ids: optional `[B]` int sentence ids of the anchors (corpus indices).
    queue_ids: optional `[Q]` int sentence ids of the queue entries, -1 for empty slots.
    mask_same_sentence: with both id arrays, drop queue entries of the anchor's sentence.
    row_mask: optional `[B]`, 0 for the padding rows of a padded batch: such a row is no
      anchor (left out of the mean and of every metric) and no negative of any anchor.

  Returns:
    (loss, metrics) with metrics `infonce` (the loss), `pos_cos` (mean positive
    cosine), `neg_cos` (mean in-batch negative cosine; 0 when B == 1) and `acc`
    (fraction of rows whose positive has the largest logit). With a queue also
    `queue_masked_frac` (fraction of the B x Q anchor/slot pairs left out of the
    denominator: empty, or the anchor's own sentence when masked) and, with ids,
    `queue_self_frac` (fraction of pairs whose slot holds the anchor's own sentence,
    masked or not).
  """
  dtype = _compute_dtype(z1)
  z1n = l2_normalize(z1.astype(dtype))
  z2n = l2_normalize(z2.astype(dtype))
  cos = z1n @ z2n.T  # [B, B]
  logits = cos / temperature
  if row_mask is not None:  # padding rows are nobody's negative (a row keeps its own positive)
    real = row_mask.astype(bool)
    others = ~real[None, :] & ~jnp.eye(cos.shape[0], dtype=bool)
    logits = jnp.where(others, _MASKED_LOGIT, logits)
  queue_metrics = {}
  if queue is not None:
    with_ids = anchor_ids is not None and queue_ids is not None
    self_pairs = same_sentence(anchor_ids, queue_ids) if with_ids else None
    dropped = self_pairs if mask_same_sentence else None
    logits = jnp.concatenate(
        [logits, _queue_logits(z1n, queue, queue_valid, temperature, dropped)], axis=1)
    queue_metrics = _queue_metrics(queue_valid, self_pairs, dropped, (z1.shape[0], queue.shape[0]),
                                   row_mask)
  pos_logit = diagonal(logits)
  loss = row_mean(jax.nn.logsumexp(logits, axis=1) - pos_logit, row_mask)
  return loss, {'infonce': loss, **_in_batch_metrics(cos, logits, row_mask), **queue_metrics}
