"""`python -m micse_jax.evaluate` (installed: `micse-evaluate`): SentEval STS and transfer tasks of a
sentence encoder; the command is `micse_jax/evaluation/command.py`."""
from micse_jax.evaluation.command import run

if __name__ == "__main__":
  run()
