"""Population runs and their solo references, in-process (shared by population_test and its 4-device worker)."""
import jax
import numpy as np

from micse_jax.training import program
from tests.train_utils import prepared_program, program_steps, steps_of


def run_population(config, steps: int, devices=None, hlo: list | None = None):
  """(final PopulationState on the host, per-step metrics) of `steps` population steps on `devices`
  (the trainer's program); appends the compiled step's HLO text to `hlo` when given."""
  prog, runs = prepared_program(config, devices)
  prog = program.compiled(prog)
  if hlo is not None:
    hlo.append(prog.executable.as_text())
  _, state, history = steps_of(prog, runs, steps)
  return state, history


def run_solo(member_config, steps: int):
  """(final TrainState on the host, per-step losses) of the solo run `member_config` on one device:
  the solo program (`training/program.py`), the reference the vmapped population step must match."""
  _, state, history = program_steps(member_config, steps, jax.devices()[:1])
  return state, [float(m["loss"]) for m in history]


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
