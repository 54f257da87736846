"""Population runs and their solo references, in-process (shared by population_test and its 4-device worker)."""
import jax
import jax.numpy as jnp
import numpy as np

from micse_jax.configs import population as population_fields
from micse_jax.training import program, setup
from micse_jax.training.optim import learning_rate_schedule, make_optimizer
from micse_jax.training.step import make_train_step


def run_population(config, steps: int, devices=None, hlo: list | None = None):
  """(final PopulationState on the host, per-step metrics) of `steps` population steps on `devices`
  (the trainer's program); appends the compiled step's HLO text to `hlo` when given."""
  runs = [setup.prepare(c) for c in population_fields.member_configs(config)]
  prog = program.of_runs(config, runs, devices)
  pstate = prog.place_state([setup.initial_state(r, prog.tx) for r in runs])
  batch = lambda s: prog.place_batch([r.batches.batch(s) for r in runs])
  if hlo is not None:
    hlo.append(prog.step.lower(*prog.inputs(pstate, batch(0))).compile().as_text())
  history = []
  for s in range(steps):
    pstate, metrics = prog.step(*prog.inputs(pstate, batch(s)))
    history.append(jax.device_get(metrics))
  return jax.device_get(pstate), history


def run_solo(member_config, steps: int):
  """(final TrainState on the host, per-step losses) of the solo run `member_config`, one device
  (the pure step jitted here, independently of the program)."""
  run = setup.prepare(member_config)
  tx = make_optimizer(member_config)
  state = setup.initial_state(run, tx)
  step = jax.jit(make_train_step(member_config, run.nets, learning_rate_schedule(member_config)))
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
