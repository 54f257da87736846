"""Evaluators run during training, in the spirit of big_vision's `evaluators/` (the protocols they
run: the `micse_jax.evaluation` package around them).

Each is built once from an encoder (`micse_jax.encoder.SentenceEncoder`: model, tokenizer) and
the config, and is then called on explicit params; none writes checkpoints (the trainer owns
both Orbax managers) and none imports the trainer.

| evaluator | what it measures | file |
| --- | --- | --- |
| `DevSelection` | STS-B (+ SICK-R) dev Spearman of [CLS] before the MLP: model selection | `dev_selection.py` |
| `final_evaluation` | `eval.final_tasks` of the chosen params → `results.json` | `dev_selection.py` |
| `HeldoutMetrics` | alignment, uniformity, attention MI on a held-out slice | `heldout.py` |

Both periodic evaluators are due on the same steps: `is_due`.
"""


def is_due(done: int, every: int, num_steps: int) -> bool:
  """After `done` steps: every `every` steps and after the last one; never when `every` <= 0."""
  return every > 0 and (done % every == 0 or done == num_steps)
