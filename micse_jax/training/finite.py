"""Non-finite loss detection without a device→host sync per step.

After every step, `FiniteWatch.update` folds the step's loss into two device scalars (one tiny
jitted call, dispatched asynchronously like the step): the first step whose loss was not
finite (-1 while none) and that loss. The host reads them only in `check()`, which the trainer
calls before it logs, selects or saves anything, so a non-finite state is never logged, kept
as the best model or checkpointed, while the steps in between run without waiting. A float16
step that the dynamic loss scale skipped (`step_skipped`, `training/precision.py`) is not a
failure: its update was not applied.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from micse_jax.errors import NonFiniteLossError


@jax.jit
def _fold(first_bad, bad_loss, loss, skipped, step):
  """(first_bad, bad_loss) after a step: set at the first non-finite, non-skipped loss."""
  applied = True if skipped is None else jnp.asarray(skipped) == 0
  record = (first_bad < 0) & ~jnp.isfinite(loss) & applied
  return (jnp.where(record, step.astype(jnp.int32), first_bad),
          jnp.where(record, loss.astype(jnp.float32), bad_loss))


class FiniteWatch:
  """Accumulates, on the device, whether any step so far had a non-finite loss."""

  def __init__(self):
    self._first_bad = jnp.asarray(-1, jnp.int32)
    self._bad_loss = jnp.asarray(0.0, jnp.float32)

  def update(self, metrics: dict, step: jax.Array) -> None:
    """Folds in a step's metrics (`loss`, optional `step_skipped`); `step`: the state's step after it."""
    self._first_bad, self._bad_loss = _fold(self._first_bad, self._bad_loss, metrics["loss"],
                                            metrics.get("step_skipped"), step)

  def check(self, saved_step: int | None = None) -> None:
    """Reads the flag (one sync); raises NonFiniteLossError (one line) if any step was non-finite,
    saying what the run left (`saved_step`: its last checkpoint's step, None when it saved none)."""
    first_bad = int(np.asarray(self._first_bad))
    if first_bad >= 0:
      loss = float(np.asarray(self._bad_loss))
      raise NonFiniteLossError(f"non-finite loss {loss} at step {first_bad}; stopped, {kept_clause(saved_step)} "
                               "(lower optim.learning_rate?)")


def kept_clause(saved_step: int | None) -> str:
  """What a run stopped for a non-finite update leaves: its last checkpoint, or none."""
  if saved_step is None:
    return "before any checkpoint was saved (nothing to resume from)"
  return f"the last saved checkpoint (step {saved_step}) is intact"
