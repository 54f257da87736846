"""The non-finite policy (`training/non_finite.py`): which updates are skipped, what a skipped step keeps,
when a member stops; the Watch: the first non-finite (and not skipped) loss is remembered on the
device, folded in jitted as the program does, read at check()."""
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from micse_jax.errors import NonFiniteLossError
from micse_jax.training import non_finite
from tests.update_test import make_params


@flax.struct.dataclass
class _Fields:
  """A state with one field besides those `update.apply` writes (left None here)."""
  step: jax.Array
  params: object = None
  opt_state: object = None
  ema_params: object = None
  compute_weights: object = None

def _run(losses, skipped=None) -> non_finite.Watch:
  fold = jax.jit(non_finite.fold)  # as the program folds each step in
  watch = non_finite.Watch.fresh()
  for step, loss in enumerate(losses, start=1):
    metrics = {"loss": jnp.float32(loss)}
    if skipped is not None:
      metrics["step_skipped"] = jnp.int32(skipped[step - 1])
    watch = fold(watch, metrics, jnp.int32(step))
  return watch


def test_finite_losses_pass():
  non_finite.check(_run([1.0, 0.5, 3.0]))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_first_non_finite_step_is_reported_later(bad):
  watch = _run([1.0, bad, 2.0, np.nan, 0.1])  # finite again after: still reported, at step 2
  with pytest.raises(NonFiniteLossError, match=r"non-finite loss (nan|inf|-inf) at step 2;") as e:
    non_finite.check(watch)
  assert "\n" not in str(e.value)


def test_skipped_float16_steps_are_not_failures():
  non_finite.check(_run([1.0, np.inf, np.nan], skipped=[0, 1, 1]))
  with pytest.raises(NonFiniteLossError, match="at step 3"):
    non_finite.check(_run([1.0, np.inf, np.nan], skipped=[0, 1, 0]))


def test_rest_kept_selects_only_what_the_update_does_not_write():
  from micse_jax.training.momentum import Queue
  from micse_jax.training.state import create_train_state
  old = create_train_state(make_params(), optax.sgd(0.1), seed=0, momentum=True, queue_size=3, dim=4,
                           loss_scale={"scale": jnp.float32(8.0)}, compute_dtype=jnp.bfloat16)
  new = old.replace(step=old.step + 1, params=jax.tree.map(lambda p: p + 1, old.params),
                    queue=Queue.empty(3, 4).replace(ptr=jnp.asarray(2, jnp.int32)), loss_scale={"scale": jnp.float32(4.0)})
  stopped = non_finite.rest_kept(jnp.asarray(False), new, old)
  assert int(stopped.step) == 0 and int(stopped.queue.ptr) == 0 and float(stopped.loss_scale["scale"]) == 8.0
  assert stopped.params is new.params and stopped.compute_weights is new.compute_weights  # the update's own
  trained = non_finite.rest_kept(jnp.asarray(True), new, old)
  assert int(trained.step) == 1 and int(trained.queue.ptr) == 2 and float(trained.loss_scale["scale"]) == 4.0


@pytest.mark.parametrize("alive, loss, scaling, keep, skip", [
    (None, np.nan, False, True, False),      # a solo float32 run applies every update (the Watch stops it)
    (None, np.nan, True, True, True),        # float16: a non-finite norm skips it
    (True, 1.0, False, True, True),          # a member that trains, finite loss: kept unless its norm is not finite
    (True, np.inf, False, False, True),      # its loss not finite: skipped
    (False, 1.0, False, False, True)])       # a stopped member: skipped
def test_which_updates_are_skipped(alive, loss, scaling, keep, skip):
  mask = non_finite.update_mask(None if alive is None else jnp.asarray(alive), jnp.float32(loss), scaling)
  assert bool(mask["keep"]) == keep and mask["skip_nonfinite"] == skip


@pytest.mark.parametrize("loss, norm, skipped, alive, bad", [
    (1.0, 2.0, 0, True, False), (np.nan, 2.0, 0, True, True), (1.0, np.inf, 0, True, True),
    (np.nan, np.nan, 1, True, False),  # a float16 step the loss scale skipped is no failure
    (np.nan, 2.0, 0, False, True)])    # reported as bad; `stopped_after` keeps its first step
def test_a_member_goes_bad_on_an_applied_non_finite_step(loss, norm, skipped, alive, bad):
  metrics = {"loss": jnp.float32(loss), "grad_norm": jnp.float32(norm), "step_skipped": jnp.int32(skipped)}
  kept, went_bad = non_finite.member_kept(jnp.asarray(alive), _Fields(jnp.int32(4)), _Fields(jnp.int32(3)), metrics)
  assert bool(went_bad) == bad
  assert int(kept.step) == (4 if alive and not bad else 3)
  stopped_at = non_finite.stopped_after(jnp.int32([non_finite.STOPPED, 1]), jnp.asarray([bad, True]), jnp.int32(7))
  assert stopped_at.tolist() == [7 if bad else non_finite.STOPPED, 1]
