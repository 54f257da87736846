"""Fixed-size ring buffer of momentum-encoder embeddings: extra negatives (miCSE §2.1, MoCo).

Static shapes: the queue is a `[Q, D]` array with a write pointer and a validity mask; a push
writes the whole global batch at `(ptr + arange(B)) % Q` and advances the pointer.
"""
import jax
import jax.numpy as jnp


def empty_queue(size: int, dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(embeddings [Q, D], valid [Q] bool, pointer int32)."""
  return jnp.zeros((size, dim), jnp.float32), jnp.zeros((size,), bool), jnp.zeros((), jnp.int32)


def enqueue(queue: jax.Array, valid: jax.Array, ptr: jax.Array, batch: jax.Array):
  """Writes `batch` [B, D] (B ≤ Q) into the ring at `ptr`; oldest entries are overwritten."""
  size, n = queue.shape[0], batch.shape[0]
  slots = (ptr + jnp.arange(n)) % size
  queue = queue.at[slots].set(batch.astype(queue.dtype))
  valid = valid.at[slots].set(True)
  return queue, valid, ((ptr + n) % size).astype(jnp.int32)
