"""FiniteWatch: the first non-finite (and not skipped) loss is remembered on the device, read at check()."""
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.errors import NonFiniteLossError
from micse_jax.training.finite import FiniteWatch


def _run(losses, skipped=None):
  watch = FiniteWatch()
  for step, loss in enumerate(losses, start=1):
    metrics = {"loss": jnp.float32(loss)}
    if skipped is not None:
      metrics["step_skipped"] = jnp.int32(skipped[step - 1])
    watch.update(metrics, jnp.int32(step))
  return watch


def test_finite_losses_pass():
  _run([1.0, 0.5, 3.0]).check()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_first_non_finite_step_is_reported_later(bad):
  watch = _run([1.0, bad, 2.0, np.nan, 0.1])  # finite again after: still reported, at step 2
  with pytest.raises(NonFiniteLossError, match=r"non-finite loss (nan|inf|-inf) at step 2;") as e:
    watch.check()
  assert "\n" not in str(e.value)


def test_skipped_float16_steps_are_not_failures():
  _run([1.0, np.inf, np.nan], skipped=[0, 1, 1]).check()
  with pytest.raises(NonFiniteLossError, match="at step 3"):
    _run([1.0, np.inf, np.nan], skipped=[0, 1, 0]).check()
