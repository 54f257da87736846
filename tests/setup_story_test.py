"""The trainer's set-up reads as one story: each of its lines is one call into a module that does that
step, no module is entered twice, the steps come in the documented order, and the log says them."""
import logging

from micse_jax.training import trainer
from tests.train_utils import set_up_calls, tiny_training_config

# The steps' modules in `trainer._train_and_evaluate`'s documented order (config, devices, caches, data,
# program (its `chunk_size=auto` the last input check), the workdir's checkpoints, state, runs' folders).
ORDER = ["training.precision", "config_checks", "training.distributed", "caches", "training.run_inputs",
         "training.program", "workdir", "training.checkpoint", "training.run_slices"]


def _direct_calls_of_the_set_up(config, workdir) -> list[str]:
  """The package modules (the trainer's own and the timeline's clock left out) that the set-up function
  calls directly, in call order, until the loop starts."""
  story = trainer._train_and_evaluate.__code__

  def direct(frame) -> bool:
    module = frame.f_globals.get("__name__", "")
    return (frame.f_back is not None and frame.f_back.f_code is story and module.startswith("micse_jax.")
            and module not in ("micse_jax.training.trainer", "micse_jax.timeline"))
  return [m.removeprefix("micse_jax.") for m in set_up_calls(config, workdir, direct)]


def test_the_set_up_enters_each_module_once_in_the_story_order_and_says_each_step(tmp_path, minilm_dir, caplog):
  config = tiny_training_config(tmp_path, minilm_dir)  # the tiny run: a program other tests compile too
  with caplog.at_level(logging.INFO):
    calls = _direct_calls_of_the_set_up(config, str(tmp_path / "run"))
  stays = [m for i, m in enumerate(calls) if i == 0 or calls[i - 1] != m]
  assert len(stays) == len(set(stays)), stays  # no module entered twice
  assert stays == ORDER, stays
  said = [r.getMessage().removeprefix("set-up: ").split(" ")[0] for r in caplog.records
          if r.getMessage().startswith("set-up: ")]
  assert said == ["config", "data:", "program", "state:", "evaluators:", "training"], said
