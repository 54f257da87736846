"""Train a sentence encoder: `python -m micse_jax.main --config configs/micse.py --workdir DIR`
(installed: `micse-train --config micse --workdir DIR`).

Every config field can be overridden, e.g. `--config.batch_size=64 --config.ami.weight=5e-3`;
variants: `--config configs/micse.py:demo` (a file) or `--config micse:demo` (a packaged config,
from any directory; `--list_configs` lists them). Re-running with the same workdir resumes.
A flag or override that does not parse exits 2, bad input (`MicseError`) exits 1, each with one
`error:` line; anything else is a bug and keeps its traceback.
"""
import logging

import ml_collections
from absl import flags
from ml_collections import config_flags

from micse_jax import cli

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Training config: a file `path.py[:variant]` or a packaged config's name "
    "(`micse:demo`; --list_configs lists them).", lock_config=True)
flags.DEFINE_bool("list_configs", False, "Print the packaged configs' names and exit.")
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs, config.json, results.json.")
flags.mark_flags_as_required(["config", "workdir"])


def train(config: ml_collections.ConfigDict, workdir: str, overridden=()) -> dict:
  """Trains with bad input reported as one line (exit 1); returns the final results. `overridden`:
  the config fields given on the command line (a member field a population replaces is refused)."""
  # Imported here so `--help` and flag errors stay fast.
  from micse_jax import config_checks
  from micse_jax import workdir as workdir_lib
  from micse_jax.training import distributed, trainer
  with cli.input_errors_as_one_line():
    if overridden:
      config_checks.check_command_line(config, set(overridden))
    distributed.maybe_initialize_distributed()
    results = trainer.train_and_evaluate(config, workdir)
  workdir_lib.print_run_summary(workdir)
  return results


def main(argv) -> None:
  """Trains `--config` into `--workdir` (absl main)."""
  cli.reject_extra_args(argv)
  logging.getLogger("absl").setLevel(logging.WARNING)
  train(FLAGS.config, FLAGS.workdir, FLAGS["config"].override_values)


def run() -> None:
  """Entry point (`micse-train`): flags and overrides are checked (one line, exit 2) before
  anything else runs."""
  cli.run_program(main, materialize=lambda: FLAGS.config.to_dict())


if __name__ == "__main__":
  run()
