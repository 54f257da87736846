"""Train a sentence encoder: `python -m micse_jax.main --config configs/micse.py --workdir DIR`.

Every config field can be overridden, e.g. `--config.batch_size=64 --config.ami.weight=5e-3`;
variants: `--config configs/micse.py:demo`. Re-running with the same workdir resumes.
"""
import logging
import sys

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Training config file (`path.py[:variant]`).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs, config.json, results.json.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  # Imported here so `--help` and flag errors stay fast.
  from micse_jax.data.corpus import CorpusError  # pylint: disable=import-outside-toplevel
  from micse_jax.models.loading import ModelLoadError  # pylint: disable=import-outside-toplevel
  from micse_jax.training import mesh, trainer  # pylint: disable=import-outside-toplevel
  logging.getLogger("absl").setLevel(logging.WARNING)
  mesh.maybe_initialize_distributed()
  try:
    trainer.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except (CorpusError, ModelLoadError, trainer.NonFiniteLossError, ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


def run() -> None:
  """`app.run(main)`, with a bad `--config.*` override reported as one line (exit 2)."""
  try:
    app.run(main)
  except (AttributeError, KeyError, TypeError, ValueError) as e:  # raised while parsing --config.*
    print(f"error: invalid --config override: {e} (see configs/default.py for the fields)",
          file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  run()
