"""float16 training: dynamic loss scaling (jmp rule), skipped steps on infinities, the scale
state across checkpoint/resume, and fp16 vs fp32 loss on one fixed batch."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from micse_jax import workdir as workdir_lib
from micse_jax.training import checkpoint, non_finite, precision, trainer, update
from micse_jax.training.momentum import Queue
from micse_jax.training.state import TrainState
from tests.train_utils import prepared_program, program_steps, tiny_training_config


def _toy_state(loss_scale):
  return TrainState(step=jnp.asarray(5, jnp.int32), params={"w": jnp.ones(3)}, ema_params={"w": jnp.zeros(3)},
                    opt_state={"mu": jnp.full(3, 0.5)}, queue=Queue.empty(2, 3), rng=jax.random.PRNGKey(0), loss_scale=loss_scale)


def _scale_state(scale, counter=0, skipped=0):
  return {"scale": jnp.asarray(scale, jnp.float32), "counter": jnp.asarray(counter, jnp.int32),
          "skipped_steps": jnp.asarray(skipped, jnp.int32)}


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_injected_non_finite_gradient_skips_the_update_and_halves_the_scale(bad):
  """The update skips the step itself (`update.apply` with `skip_nonfinite`: params and moments
  unchanged; the EMA too, `tests/update_test.py`), `non_finite.loss_scaled_step` keeps the queue, advances the
  step and halves the scale."""
  adamw = optax.adamw(1e-2)
  tx = optax.chain(optax.clip_by_global_norm(1.0), adamw)
  previous = _toy_state(_scale_state(1024.0, counter=7, skipped=2)).replace(opt_state=tx.init({"w": jnp.ones(3)}))
  grads = {"w": jnp.array([1.0, bad, 2.0])}
  result = update.apply(update.Inputs(inner=adamw, grads=grads, params=previous.params, opt_state=previous.opt_state,
                                       max_norm=1.0, skip_nonfinite=True))
  assert not bool(result.applied) and not np.isfinite(float(result.grad_norm))
  updated = previous.replace(step=previous.step + 1, params=result.params, opt_state=result.opt_state,
                             queue=Queue.empty(2, 3).replace(valid=jnp.ones(2, bool), ptr=jnp.asarray(1, jnp.int32)))
  new, metrics = non_finite.loss_scaled_step(jnp.isfinite(result.grad_norm), updated, previous, period=2000)
  assert int(new.step) == 6  # the data position advances
  for name in ("params", "opt_state", "queue"):
    for kept, before in zip(jax.tree.leaves(getattr(new, name)), jax.tree.leaves(getattr(previous, name))):
      np.testing.assert_array_equal(kept, before)
  assert float(new.loss_scale["scale"]) == 512.0 and int(new.loss_scale["counter"]) == 0
  assert int(new.loss_scale["skipped_steps"]) == 3
  assert int(metrics["step_skipped"]) == 1 and int(metrics["skipped_steps"]) == 3


def test_finite_gradient_keeps_the_update_and_doubles_the_scale_every_period():
  previous = _toy_state(_scale_state(1024.0, counter=2, skipped=1))
  updated = previous.replace(step=previous.step + 1, params={"w": jnp.full(3, 9.0)})
  new, metrics = non_finite.loss_scaled_step(jnp.asarray(True), updated, previous, period=3)
  np.testing.assert_array_equal(new.params["w"], np.full(3, 9.0))
  # counter 2 == period - 1: this finite step completes a period, S -> 2S, counter -> 0
  assert float(new.loss_scale["scale"]) == 2048.0 and int(new.loss_scale["counter"]) == 0
  assert int(new.loss_scale["skipped_steps"]) == 1 and int(metrics["step_skipped"]) == 0
  again, _ = non_finite.loss_scaled_step(jnp.asarray(True), new.replace(step=new.step + 1), new, period=3)
  assert float(again.loss_scale["scale"]) == 2048.0 and int(again.loss_scale["counter"]) == 1


def test_scaled_gradient_is_unscaled():
  loss_fn = lambda w: (jnp.sum(w ** 2), {})
  (loss, _), grads = precision.value_and_unscaled_grad(loss_fn, _scale_state(2.0 ** 12), 2000)(jnp.arange(3.0))
  assert float(loss) == 5.0  # the unscaled loss is reported
  np.testing.assert_allclose(grads, 2 * np.arange(3.0))


def _one_step(config):
  init, state, (metrics,) = program_steps(config, 1)
  return init, state, metrics


@pytest.mark.slow  # ~30 s on 2 cores (CI budget); float16 steps stay in the default run (overflow, loss-scale resume)
def test_float16_and_float32_give_the_same_loss_on_a_fixed_batch(tmp_path, tiny_real_dir):
  """Same params, batch, dropout masks and AMI samples; only the compute dtype differs.

  Stated tolerance: 1e-3 relative on the loss and InfoNCE, 2e-3 absolute on the mean AMI
  mutual information (measured: ~3e-5 relative and ~3e-5 absolute; fp16 rounds at ~5e-4
  relative, the logits, logs and correlations are float32 in both runs).
  """
  results = {}
  for dtype in ("float32", "float16"):
    config = tiny_training_config(tmp_path, tiny_real_dir)
    config.model.name_or_path, config.model.dtype = tiny_real_dir, dtype
    _, _, results[dtype] = _one_step(config)
  f32, f16 = results["float32"], results["float16"]
  assert np.isfinite(f16["loss"]) and "loss_scale" in f16 and "loss_scale" not in f32
  assert f16["infonce"] == pytest.approx(f32["infonce"], rel=1e-3)
  assert f16["ami_mi"] == pytest.approx(f32["ami_mi"], abs=2e-3)
  assert f16["ami_samples"] == f32["ami_samples"]  # the same cells were sampled
  assert f16["loss"] == pytest.approx(f32["loss"], rel=1e-3)


def test_float16_overflow_skips_the_step_instead_of_failing(tmp_path, minilm_dir, monkeypatch):
  """S = 2^40 makes every float16 backward pass overflow: steps are skipped, counted, logged."""
  config = tiny_training_config(tmp_path, minilm_dir, num_train_steps=3, checkpoint_every=3)
  config.model.dtype, config.model.loss_scale_init = "float16", 2.0 ** 40
  logged = {}
  from micse_jax.training import summaries
  real_write = summaries.write_scalars
  monkeypatch.setattr(summaries, "write_scalars",
                      lambda writer, step, scalars: (logged.setdefault(step, dict(scalars)),
                                                     real_write(writer, step, scalars)))
  workdir = str(tmp_path / "fp16_overflow")
  trainer.train_and_evaluate(config, workdir)  # no NonFiniteLossError
  assert [logged[s]["skipped_steps"] for s in (1, 2, 3)] == [1, 2, 3]
  assert [logged[s]["loss_scale"] for s in (1, 2, 3)] == [2.0 ** 40, 2.0 ** 39, 2.0 ** 38]
  prog, runs = prepared_program(config)
  init = jax.device_get(prog.initial_state(runs))
  final = checkpoint.restore_state(workdir_lib.rolling_manager(workdir, 2), prog.abstract_state)
  assert int(final.step) == 3
  for a, b in zip(jax.tree.leaves((init.params, init.opt_state, init.ema_params, init.queue)),
                  jax.tree.leaves((final.params, final.opt_state, final.ema_params, final.queue))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # ~30 s: float16 overflow skipping stays in the default run
def test_loss_scale_state_survives_checkpoint_and_resume(tmp_path, minilm_dir, caplog):
  """period 1 doubles S after every finite step: 1 → 4 after two steps, → 16 after four
  (a resume that reset the scale would end at 4). The longer run says once that its learning rate's
  decay now ends later (`resume_checks.resume_notes`)."""
  config = tiny_training_config(tmp_path, minilm_dir, num_train_steps=2, checkpoint_every=2)
  config.model.dtype, config.model.loss_scale_init, config.model.loss_scale_period = "float16", 1.0, 1
  workdir = str(tmp_path / "fp16_resume")
  trainer.train_and_evaluate(config, workdir)
  abstract = prepared_program(config)[0].abstract_state
  saved = checkpoint.restore_state(workdir_lib.rolling_manager(workdir, 2), abstract)
  assert float(saved.loss_scale["scale"]) == 4.0 and int(saved.loss_scale["skipped_steps"]) == 0
  config.num_train_steps = 4
  with caplog.at_level(logging.WARNING):
    trainer.train_and_evaluate(config, workdir)
  notes = [r.getMessage() for r in caplog.records if "changes on resume" in r.getMessage()]
  assert len(notes) == 1 and notes[0].startswith("num_train_steps changes on resume (2 -> 4): the learning rate's")
  resumed = checkpoint.restore_state(workdir_lib.rolling_manager(workdir, 2), abstract)
  assert int(resumed.step) == 4 and float(resumed.loss_scale["scale"]) == 16.0
  assert {x.dtype for x in jax.tree.leaves(resumed.params)} == {np.dtype("float32")}


@pytest.mark.parametrize("field,value", [("dtype", "float8"), ("loss_scale_init", 0.0),
                                         ("loss_scale_period", 0), ("dropout_random_bits", 8)])
def test_bad_precision_config_is_a_config_error(tmp_path, minilm_dir, field, value):
  from micse_jax import config_checks
  from micse_jax.errors import ConfigError
  config = tiny_training_config(tmp_path, minilm_dir)
  config.model[field] = value
  with pytest.raises(ConfigError, match=f"model.{field}"):
    config_checks.check_config(config)
