"""The one explicit train-state pytree."""
from typing import Any

import flax
import jax
import jax.numpy as jnp

from micse_jax.training.momentum import empty_queue, empty_queue_ids


@flax.struct.dataclass
class TrainState:
  step: jax.Array          # int32 scalar: optimizer steps taken == data position
  params: Any              # {'encoder': BERT params, 'head': MLP params}
  ema_params: Any          # momentum-encoder BERT params ({} when momentum is off)
  opt_state: Any
  queue: jax.Array         # [Q, D] normalised momentum embeddings ({} when momentum is off)
  queue_valid: jax.Array   # [Q] bool: slot has been written
  queue_ptr: jax.Array     # int32 scalar: next slot to write
  queue_ids: jax.Array     # [Q] int32 corpus sentence id per slot, -1 while empty
  rng: jax.Array           # uint32[2] base key; each step folds in `step`
  # float16 only: {'scale', 'counter', 'skipped_steps'} of dynamic loss scaling (precision.py)
  loss_scale: Any = flax.struct.field(default_factory=dict)
  frozen_params: Any = None  # never trained (InfoCSE: lower half of the initial encoder); {} when unused


def create_train_state(params, tx, *, seed: int, momentum: bool, queue_size: int, dim: int,
                       frozen_params=None, loss_scale: dict | None = None) -> TrainState:
  """Step 0: the given params and optimizer state, an empty queue and EMA = online encoder (if momentum)."""
  # Without momentum there is no queue: empty subtrees (Orbax cannot store zero-size arrays).
  queue, valid, ptr = empty_queue(queue_size, dim) if momentum else ({}, {}, {})
  queue_ids = empty_queue_ids(queue_size) if momentum else {}
  return TrainState(
      step=jnp.zeros((), jnp.int32), params=params,
      ema_params=jax.tree.map(jnp.copy, params["encoder"]) if momentum else {},
      opt_state=tx.init(params), queue=queue, queue_valid=valid, queue_ptr=ptr,
      queue_ids=queue_ids, rng=jax.random.PRNGKey(seed), frozen_params=frozen_params or {},
      loss_scale=loss_scale or {})
