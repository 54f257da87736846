"""The non-finite policy in one place: what a non-finite loss or gradient does to an update, to a
population member and to a run. The step (`training/step.py`), the population step
(`training/population.py`) and the loop (`training/trainer.py`) call these rules; none has its own.

  skip the update   a float16 step whose gradient norm ‖g‖₂ is not finite (the scaled loss
                    overflowed, Micikevicius et al. 2018), and a population member's step while
                    the member is stopped or when its loss or ‖g‖₂ is not finite, apply no update:
                    params, moments, EMA and copies stay as they were (`update_mask`: the mask
                    `update.apply` keeps them by in its own pass), the rest of the state by the
                    same mask (`rest_kept`). A skipped float16 step still advances the step (the
                    data position) and halves the loss scale (`loss_scaled_step`).
  stop the member   a member whose applied step had a non-finite loss or ‖g‖₂ stops at that step
                    (`member_kept`, `stopped_after`): its state stays as it was, the others go on.
  stop the run      a solo run whose applied step had a non-finite loss stops with one error line
                    (`Watch`, folded in by the program at every step: `fold`), a population once no
                    member trains (`Health`).

The loop learns of either only when it logs, evaluates or saves, from what the program's call
returned beside the state (the steps in between run without waiting), so a non-finite state is
never logged, kept as the best model or checkpointed. A float16 step the loss scale skipped (`step_skipped`) is never a failure: its
update was not applied.
"""
from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np

from micse_jax import workdir as workdir_lib
from micse_jax.errors import NonFiniteLossError
from micse_jax.training import precision, update
from micse_jax.workdir import STOPPED_STATE

STOPPED = -1  # a population member's `stopped_at` while it trains


# ---------------------------------------------------------------- skip the update


def update_mask(alive: jax.Array | None, loss: jax.Array, loss_scaling: bool) -> dict:
  """`update.Inputs`' `keep` and `skip_nonfinite` for a step: a solo run (`alive` None) keeps every
  update but, with float16 loss scaling, one whose ‖g‖₂ is not finite; a population member keeps
  it only while it trains (`alive`) and its loss and ‖g‖₂ are finite."""
  if alive is None:
    return {"keep": True, "skip_nonfinite": loss_scaling}
  return {"keep": alive & jnp.isfinite(loss), "skip_nonfinite": True}


def rest_kept(keep: jax.Array, new, old):
  """The train state `new` with every field that `update.apply` does not write (step, queue, loss
  scale, ...) taken from `old` where `keep` is false: the select over the small rest of the state,
  `apply` having kept its own fields in the same pass (no select over params, moments, EMA and copies)."""
  rest = lambda state: state.replace(**{name: None for name in update.WRITTEN})
  kept = update.where(jnp.asarray(keep, bool), rest(new), rest(old))
  return kept.replace(**{name: getattr(new, name) for name in update.WRITTEN})


def loss_scaled_step(finite: jax.Array, updated, previous, period: int) -> tuple:
  """The new train state of a float16 step whose gradients were `finite` (or not), and its metrics.

  The update skipped a non-finite step already (`update_mask`); here the rest of the state (the
  queue) is kept as in `previous` too, while the step counter (= data position) advances, and the
  loss scale is adjusted (`precision.adjusted_loss_scale`). Returns (state, metrics) with
  `loss_scale`, `skipped_steps` and `step_skipped`; (updated, {}) without loss scaling."""
  if not previous.loss_scale:
    return updated, {}
  finite = jnp.asarray(finite, bool)
  kept = rest_kept(finite, updated, previous.replace(step=updated.step))
  loss_scale, metrics = precision.adjusted_loss_scale(previous.loss_scale, finite, period)
  return kept.replace(loss_scale=loss_scale), metrics


# ---------------------------------------------------------------- stop the member


def member_kept(alive: jax.Array, new, old, metrics: dict) -> tuple:
  """(state, went_bad) of a population member's step: `new` while the member trains and its applied
  step was finite; else `old` (the update kept its own fields already, `update_mask`)."""
  applied = metrics.get("step_skipped", jnp.asarray(0)) == 0
  bad = applied & ~(jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]))
  return rest_kept(alive & ~bad, new, old), bad


def stopped_after(stopped_at: jax.Array, bad: jax.Array, step: jax.Array) -> jax.Array:
  """The members' `stopped_at` after population step `step`: a member that trained and went bad stops there."""
  return jnp.where((stopped_at == STOPPED) & bad, step, stopped_at).astype(jnp.int32)


# ---------------------------------------------------------------- stop the run


@flax.struct.dataclass
class Watch:
  """A solo run's non-finite record, carried through the program's calls (`training/program.py`):
  the first step whose applied loss was not finite (-1 while none) and that loss. The program
  folds every step into it (`fold`), so watching costs no dispatch of its own; the loop reads it
  only when it logs, evaluates or saves."""
  first_bad: jax.Array
  bad_loss: jax.Array

  @classmethod
  def fresh(cls) -> "Watch":
    """No non-finite step yet."""
    return cls(jnp.asarray(-1, jnp.int32), jnp.asarray(0.0, jnp.float32))


def fold(watch: Watch, metrics: dict, step) -> Watch:
  """`watch` after a step with `metrics` (`loss`, optional `step_skipped`); `step`: the state's step
  after it. Records the first non-finite loss of a step whose update was applied (a float16 step
  the loss scale skipped is no failure)."""
  skipped = metrics.get("step_skipped")
  applied = True if skipped is None else jnp.asarray(skipped) == 0
  record = (watch.first_bad < 0) & ~jnp.isfinite(metrics["loss"]) & applied
  return Watch(jnp.where(record, jnp.asarray(step).astype(jnp.int32), watch.first_bad),
               jnp.where(record, metrics["loss"].astype(jnp.float32), watch.bad_loss))


def check(watch: Watch, saved_step: int | None = None) -> None:
  """Reads `watch` (a sync, unless its call is done); raises NonFiniteLossError (one line) if any
  step was non-finite, saying what the run left (`saved_step`: its last checkpoint's step, None
  when it saved none)."""
  first_bad = int(np.asarray(watch.first_bad))
  if first_bad >= 0:
    loss = float(np.asarray(watch.bad_loss))
    raise NonFiniteLossError(f"non-finite loss {loss} at step {first_bad}; stopped, {kept_clause(saved_step)} "
                             "(lower optim.learning_rate?)")


class Health:
  """Which of the loop's runs (`run_slices.RunView`s: a solo run, or each member) still train, read
  only when the loop logs, evaluates or saves, from what the program's last call returned beside the
  state (`Program.run`): a solo run's `Watch`, a population's `stopped_at`."""

  def __init__(self, views: list, stopped_at=None):
    """`stopped_at`: a population's members' at the start (a member training again after a
    resume has its stale record cleared)."""
    self.views, self.reported = views, set()
    if views[0].index is not None:
      for i in _alive_indices(stopped_at):
        workdir_lib.clear_member_stopped(views[i].folder)

  def alive(self, health, saved_step: int | None, write) -> list:
    """The runs that still train, from `health` (a solo run's `Watch`, a population's `stopped_at`);
    a newly stopped member is reported (`write`: a line to the user) and recorded in its folder.
    NonFiniteLossError (one line, saying what `saved_step` left) when none does."""
    if self.views[0].index is None:
      check(health, saved_step)
      return self.views
    alive = _alive_indices(health)
    for i, step in newly_stopped(health, self.reported):
      view = self.views[i]
      line = stopped_line(i, view.run.config.seed, step, len(alive))
      write(line)  # once, above the progress bar (a log line as well would print it twice)
      if jax.process_index() == 0:
        workdir_lib.record_member_stopped(view.folder, step, line)
    if not alive:
      stops = ", ".join(f"member {i} at step {int(s)}" for i, s in enumerate(np.asarray(health)))
      raise NonFiniteLossError(f"every population member went non-finite ({stops}); stopped, "
                               f"{kept_clause(saved_step)} (lower optim.learning_rate?)")
    return [self.views[i] for i in alive]


def _alive_indices(stopped_at) -> list[int]:
  return [i for i, s in enumerate(np.asarray(stopped_at)) if s == STOPPED]


def newly_stopped(stopped_at, reported: set[int]) -> list[tuple[int, int]]:
  """(member, step) of members stopped and not yet in `reported` (which this adds them to)."""
  found = [(i, int(s)) for i, s in enumerate(np.asarray(stopped_at)) if s != STOPPED and i not in reported]
  reported.update(i for i, _ in found)
  return found


def stopped_line(index: int, seed: int, step: int, alive: int) -> str:
  """The one line that reports a member stopped for a non-finite update."""
  return (f"population member {index} (seed {seed}) stopped: non-finite loss or gradient at step {step}; "
          f"{STOPPED_STATE}, {alive} member(s) go on (lower optim.learning_rate?)")


def kept_clause(saved_step: int | None) -> str:
  """What a run stopped for a non-finite update leaves: its last checkpoint, or none."""
  if saved_step is None:
    return "before any checkpoint was saved (nothing to resume from)"
  return f"the last saved checkpoint (step {saved_step}) is intact"
