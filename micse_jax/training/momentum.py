"""The momentum encoder and its queue of negatives (miCSE §2.1/§3.1, MoCo).

1. After each optimizer step the momentum encoder follows the online one by an exponential
   moving average: target ← m·target + (1−m)·online (`ema_update`).
2. The momentum encoder (dropout p_m) and the online MLP head embed the batch, without
   gradient (`momentum_embeddings`).
3. Those embeddings are pushed into a fixed-size ring buffer, the queue of extra negatives for
   InfoNCE (miCSE Eq. 2) (`Queue.push`).

Static shapes: the queue is a `[Q, D]` array with a write pointer and a validity mask; a push
writes the whole global batch at `(ptr + arange(B)) % Q` and advances the pointer. Beside the
keys the queue keeps each entry's sentence id (`[Q]` int32, -1 while empty), written at the
same slots, so InfoNCE can recognise an anchor's own sentence among the negatives (on a
few-shot subset the queue routinely holds it: `losses/infonce.py`).
"""
import flax
import jax
import jax.numpy as jnp
import optax

from micse_jax.losses.infonce import l2_normalize

EMPTY_ID = -1


def ema_update(online, target, decay: float):
  """One tree-wide EMA step (optax.incremental_update; step_size = 1 − decay)."""
  return optax.incremental_update(online, target, step_size=1.0 - decay)


def momentum_embeddings(nets, ema_params, head_params, batch, key) -> jax.Array:
  """Momentum encoder (dropout p_m) + the online MLP head, L2-normalised; no gradient flows here."""
  out = nets.momentum.apply({"params": ema_params}, batch["input_ids"], batch["attention_mask"],
                            batch["token_type_ids"], deterministic=False, rngs={"dropout": key})
  z = nets.head.apply({"params": head_params}, out.last_hidden_state[:, 0])
  return jax.lax.stop_gradient(l2_normalize(z.astype(jnp.float32)))


@flax.struct.dataclass
class Queue:
  """The momentum encoder's ring buffer of negatives (miCSE §2.1): one struct, pushed as a whole.

  embeddings `[Q, D]` float32 (L2-normalised), valid `[Q]` bool (slot written), ids `[Q]` int32
  (each entry's corpus sentence id, `EMPTY_ID` while empty), ptr int32 scalar (next slot).
  """
  embeddings: jax.Array
  valid: jax.Array
  ids: jax.Array
  ptr: jax.Array

  @classmethod
  def empty(cls, size: int, dim: int) -> "Queue":
    """A queue of `size` slots of width `dim`, nothing written yet."""
    return cls(embeddings=jnp.zeros((size, dim), jnp.float32), valid=jnp.zeros((size,), bool),
               ids=jnp.full((size,), EMPTY_ID, jnp.int32), ptr=jnp.zeros((), jnp.int32))

  @property
  def size(self) -> int:
    """Q, the number of slots."""
    return self.embeddings.shape[0]

  def push(self, embeddings: jax.Array, ids: jax.Array, row_mask=None) -> "Queue":
    """Writes a batch (`embeddings` [B, D], sentence `ids` [B], B ≤ Q) at `ptr`, oldest entries
    overwritten; rows with `row_mask` 0 (padding) are never enqueued."""
    slots, written = _masked_slots(self.ptr, embeddings.shape[0], self.size, row_mask)
    return Queue(embeddings=self.embeddings.at[slots].set(embeddings.astype(self.embeddings.dtype), mode="drop"),
                 valid=self.valid.at[slots].set(True, mode="drop"),
                 ids=self.ids.at[slots].set(ids.astype(jnp.int32), mode="drop"),
                 ptr=((self.ptr + written) % self.size).astype(jnp.int32))


def _slots(ptr: jax.Array, n: int, size: int) -> jax.Array:
  return (ptr + jnp.arange(n)) % size


def _masked_slots(ptr: jax.Array, n: int, size: int, row_mask) -> tuple[jax.Array, jax.Array]:
  """(slot of each row, rows written): real rows take consecutive slots from `ptr` in batch
  order; padding rows (`row_mask` 0) get the out-of-range slot `size`, which a
  `mode="drop"` scatter skips."""
  if row_mask is None:
    return _slots(ptr, n, size), jnp.asarray(n, jnp.int32)
  real = row_mask.astype(jnp.int32)
  slots = (ptr + jnp.cumsum(real) - 1) % size
  return jnp.where(real > 0, slots, size), jnp.sum(real)


def self_collision_warning(num_sentences: int, batch_size: int, queue_size: int, masked: bool) -> str | None:
  """One warning line when a few-shot subset makes self-negatives routine, else None.

  A sentence returns every floor(n/B) steps and the queue covers Q/B steps, so once
  n < Q + B the queue holds an anchor's own sentence at most steps, on average about
  Q / (B * floor(n/B)) copies of it.
  """
  n, b, q = num_sentences, batch_size, queue_size
  if n >= q + b:
    return None
  copies = q / (b * max(n // b, 1))
  what = ("masked (momentum.mask_same_sentence=True)" if masked
          else "NOT masked (momentum.mask_same_sentence=False, as in the paper)")
  return (f"few-shot regime: n={n} training sentences < queue Q={q} + batch B={b}; the momentum "
          f"queue holds each anchor's own sentence about {copies:.2g} times; these self-negatives are "
          f"{what}")
