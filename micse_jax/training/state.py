"""The one explicit train-state pytree."""
from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from micse_jax.training import weight_copies
from micse_jax.training.momentum import Queue

Params = dict[str, Any]  # a Flax params tree: {'encoder': BERT params, 'head': MLP params, ...}


@flax.struct.dataclass
class TrainState:
  """Everything a step reads and writes; checkpointed whole (but for `compute_weights`, derived from
  the weights and rebuilt on restore), so a restore resumes bit-identically.

  The step number is the data position (`TrainBatches.batch(step)` is random access) and the
  step's random keys are `step_keys(rng, step)` (`training/step.py`).
  """
  step: jax.Array              # int32 scalar: optimizer steps taken == data position
  params: Params               # {'encoder', 'head'} + the method's extras (`networks.method_params`)
  ema_params: Params           # momentum-encoder BERT params ({} when momentum is off)
  opt_state: optax.OptState    # clipping → AdamW per leaf (`optim.make_optimizer`; updated by `update.apply`)
  queue: Queue | None          # the momentum queue of negatives (None when momentum is off)
  rng: jax.Array               # uint32[2] base key; each step folds in `step`
  # float16 only: {'scale', 'counter', 'skipped_steps'} of dynamic loss scaling (precision.py)
  loss_scale: dict[str, jax.Array] = flax.struct.field(default_factory=dict)
  frozen_params: Params = flax.struct.field(default_factory=dict)  # never trained (InfoCSE's lower half)
  # half-precision compute only: {'encoder', ('encoder_b',) 'ema'} copies of the Dense kernels at the compute dtype,
  # derived from params/ema_params and never checkpointed (`weight_copies.py`)
  compute_weights: dict = flax.struct.field(default_factory=dict)

  def without_copies(self) -> "TrainState":
    """The state a checkpoint holds: without the half-precision weight copies."""
    return self.replace(compute_weights={})

  def with_copies(self, like: "TrainState") -> "TrainState":
    """A restored state with the copies `like` (its abstract state) holds, rebuilt from the weights."""
    return self.replace(compute_weights=weight_copies.rebuilt_copies(self.params, self.ema_params,
                                                                       like.compute_weights))


def create_train_state(params: Params, tx: optax.GradientTransformation, *, seed: int, momentum: bool,
                       queue_size: int, dim: int, frozen_params: Params | None = None,
                       loss_scale: dict | None = None, compute_dtype=None) -> TrainState:
  """Step 0: the given params and optimizer state, an empty queue and EMA = online encoder (if momentum);
  with a half-precision `compute_dtype`, the kernels' copies at that dtype (`weight_copies.py`)."""
  ema_params = jax.tree.map(jnp.copy, params["encoder"]) if momentum else {}
  return TrainState(
      step=jnp.zeros((), jnp.int32), params=params, ema_params=ema_params,
      opt_state=tx.init(params), queue=Queue.empty(queue_size, dim) if momentum else None,
      rng=jax.random.PRNGKey(seed), frozen_params=frozen_params or {}, loss_scale=loss_scale or {},
      compute_weights=weight_copies.of(params, ema_params, compute_dtype))

