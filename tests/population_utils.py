"""Population runs and their solo references, in-process (shared by population_test and its 4-device worker)."""
import jax
import jax.numpy as jnp
import numpy as np

from micse_jax.training import population, population_trainer, setup
from micse_jax.training.optim import learning_rate_schedule, make_optimizer
from micse_jax.training.step import make_train_step


def run_population(config, steps: int, devices=None, hlo: list | None = None):
  """(final PopulationState on the host, per-step metrics) of `steps` population steps on `devices`;
  appends the compiled step's HLO text to `hlo` when given."""
  f = population_trainer.fresh_population(config, devices)
  runs, layout, mesh, step, pstate = f.runs, f.layout, f.mesh, f.step, f.state
  hyper = population.hyper(config)
  batches = [r.batches for r in runs]
  if hlo is not None:
    hlo.append(step.lower(pstate, population.stacked_batch(batches, layout, 0, mesh), hyper).compile().as_text())
  history = []
  for s in range(steps):
    pstate, metrics = step(pstate, population.stacked_batch(batches, layout, s, mesh), hyper)
    history.append(jax.device_get(metrics))
  return jax.device_get(pstate), history


def run_solo(member_config, steps: int):
  """(final TrainState on the host, per-step losses) of the solo run `member_config`, one device."""
  run = setup.prepare(member_config)
  tx = make_optimizer(member_config)
  state = setup.initial_state(run, tx)
  step = jax.jit(make_train_step(member_config, run.nets, tx, learning_rate_schedule(member_config)))
  losses = []
  for s in range(steps):
    state, metrics = step(state, {k: jnp.asarray(v) for k, v in run.batches.batch(s).items()})
    losses.append(float(metrics["loss"]))
  return jax.device_get(state), losses


def max_difference(a, b) -> float:
  """The largest absolute difference between two pytrees of the same structure (float64)."""
  diffs = jax.tree.leaves(jax.tree.map(
      lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) if np.size(x) else 0.0,
      a, b))
  assert diffs
  return max(diffs)


def compared_parts(state) -> dict:
  """What the equality guarantee covers: params, EMA params, queue, optimizer state, step."""
  return {"params": state.params, "ema": state.ema_params, "queue": state.queue, "opt": state.opt_state,
          "step": state.step}
