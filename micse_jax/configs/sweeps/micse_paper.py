"""miCSE's few-shot protocol on BERT-base, ready for a SLURM cluster (docs/studies/paper_protocol.md).

Variants (`--config configs/sweeps/micse_paper.py:<variant>`):

* `fewshot` — miCSE Tab. 3: SimCSE, miCSE and the two ablations (AMI+SimCSE, MoCo+SimCSE) ×
  training-set sizes 10^3, 5·10^3, 10^4, 10^5 and all of wiki1m (10^6; 0.1 %–100 %) × 5 random
  subsets. The paper's hyper-parameters: bert-base-uncased, batch 50, lr 3e-5, 250 warm-up
  steps, τ 0.05, max length 32, λ 2.5e-3, queue 384, momentum 0.995 with dropout 0.3, and the
  number of optimisation steps held constant across sizes: one epoch of 10^6 sentences at batch
  50 = 20,000 steps. 100 runs.
* `positive_only` — miCSE Tab. 4: positive-only training (no negatives) with and without AMI ×
  the same sizes × 5 subsets, same hyper-parameters. 50 runs.
* `official` — the per-split recipe of the authors' public README (SAP-samples/acl2023-micse):
  batch 64, lr 1e-5, no warm-up, AMI on layers 7–10 with `ami.variant=official`, and per split
  λ / epochs / eval interval: 0.01 % (100 sentences) 1e-3 / 2500 / 250, 0.1 % (1,000) 1e-3 / 500
  / 500, 1 % (10,000) 1e-4 / 50 / 500, 10 % (100,000) 5e-4 / 10 / 500 (a zipped axis, see
  micse_jax/studies/spec.py). Steps = epochs × ⌈n / 64⌉, the optimiser steps of the HF Trainer
  the README runs (it keeps the last partial batch). miCSE as the public code trains it (SimCSE +
  AMI, no momentum encoder) and SimCSE on the same schedule × 5 subsets. 40 runs.

    python -m micse_jax.sweep --config configs/sweeps/micse_paper.py:fewshot --executor slurm --dry_run
    python -m micse_jax.sweep --config configs/sweeps/micse_paper.py:fewshot --executor slurm --partition gpu

Subsets are drawn by `data.subset_seed` from `data.corpus` (wiki1m_for_simcse.txt under the data
directory, `$MICSE_DATA_DIR`); the seeds 48–52 are those in the names of the authors' released
split files, but the draws are ours, not those files. Every run is resumable (re-submitting the
sweep skips finished runs and resumes interrupted ones from their checkpoints).
"""
import math

import ml_collections

SIZES = (1_000, 5_000, 10_000, 100_000, 0)     # 0 = all of wiki1m (10^6 sentences, 100 %)
WIKI1M_SENTENCES = 1_000_000
SUBSET_SEEDS = (48, 49, 50, 51, 52)
PAPER_BATCH = 50
PAPER_STEPS = WIKI1M_SENTENCES // PAPER_BATCH  # one epoch of wiki1m at batch 50: 20,000
FEWSHOT_METHODS = ("simcse", "micse", "ami_simcse", "moco_simcse")
POSITIVE_ONLY_METHODS = ("positive_only", "ami_positive_only")
OFFICIAL_METHODS = ("ami_simcse", "simcse")
OFFICIAL_BATCH = 64
# (sentences, λ, epochs, eval steps) per split of the public README's four commands.
OFFICIAL_SPLITS = ((100, 1e-3, 2500, 250), (1_000, 1e-3, 500, 500), (10_000, 1e-4, 50, 500),
                   (100_000, 5e-4, 10, 500))
OFFICIAL_LAYERS = (7, 8, 9, 10)                # --min_layer 7 --max_layer 11 (end exclusive)

# GPU-hours of --dry_run: an ESTIMATE, not a measurement (no GPU row in BENCHMARKS.md yet).
# A BERT-base miCSE step at batch 50 (2 views × 50 × 32 tokens forward + backward, plus the
# momentum encoder's forward on 50 × 32) is ≈ 1.9 TFLOP; at 20 % of an H100's dense TF32 peak
# (≈ 495 TFLOP/s) that is ≈ 19 ms. 50 ms allows for small-batch overheads (AMI's top-k, the
# optimiser update, launches). Replace it with the measured `jax.pipelined_step_ms` of
# `python -m micse_jax.bench --model bert-base --batch_size 50 --no_torch` (or the GPU acceptance
# kit's BERT-base row) via `--step_ms`.
STEP_MS_ESTIMATE = 50.0
STEP_MS_NOTE = ("ESTIMATE (no GPU measurement yet): BERT-base miCSE step, batch 50, one H100, fp32 "
                "(~1.9 TFLOP/step at ~20% of TF32 peak, plus overheads); replace with the bench's "
                "jax.pipelined_step_ms via --step_ms")

PAPER_OVERRIDES = (
    ("model.name_or_path", "bert-base-uncased"),
    ("model.max_length", 32),
    ("batch_size", PAPER_BATCH),
    ("optim.learning_rate", 3e-5),
    ("optim.warmup_steps", 250),
    ("loss.temperature", 0.05),
    ("ami.weight", 2.5e-3),
    ("momentum.queue_size", 384),
    ("momentum.decay", 0.995),
    ("momentum.dropout", 0.3),
    ("momentum.mask_same_sentence", False),    # the paper's loss (our few-shot fix is opt-in here)
    ("eval_every", 125),
)


def official_steps(sentences: int, epochs: int, batch: int = OFFICIAL_BATCH) -> int:
  """Optimiser steps of `epochs` HF-Trainer epochs over `sentences` (last partial batch kept)."""
  return epochs * math.ceil(sentences / batch)


def _official(c: ml_collections.ConfigDict) -> None:
  c.name = "micse_paper_official"
  c.step_ms_note = ("ESTIMATE (no GPU measurement yet): a batch-64 SimCSE+AMI step (~2.1 TFLOP, no "
                    "momentum encoder) assumed to cost as much as the batch-50 miCSE step on one H100; "
                    "replace with the bench's jax.pipelined_step_ms (--batch_size 64) via --step_ms")
  c.overrides = (
      ("model.name_or_path", "bert-base-uncased"),
      ("model.max_length", 32),
      ("batch_size", OFFICIAL_BATCH),
      ("optim.learning_rate", 1e-5),
      ("optim.warmup_steps", 0),               # HF TrainingArguments default; the README sets none
      ("loss.temperature", 0.05),
      ("ami.variant", "official"),
      ("ami.layers", OFFICIAL_LAYERS),
  )
  split_axis = tuple((n, lam, official_steps(n, epochs), every) for n, lam, epochs, every in OFFICIAL_SPLITS)
  c.axes = (
      ("method", OFFICIAL_METHODS),
      (("data.num_sentences", "ami.weight", "num_train_steps", "eval_every"), split_axis),
      ("seed", SUBSET_SEEDS),
  )


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  c = ml_collections.ConfigDict()
  c.base_config = "micse"
  c.num_train_steps = PAPER_STEPS
  c.eval_tasks = "sts"
  c.step_ms = STEP_MS_ESTIMATE
  c.step_ms_note = STEP_MS_NOTE
  c.overrides = PAPER_OVERRIDES
  if arg == "fewshot":
    c.name = "micse_paper_fewshot"
    methods = FEWSHOT_METHODS
  elif arg == "positive_only":
    c.name = "micse_paper_positive_only"
    methods = POSITIVE_ONLY_METHODS
  elif arg == "official":
    _official(c)
    return c
  else:
    raise ValueError(f"unknown variant {arg!r}; expected 'fewshot', 'positive_only' or 'official'")
  c.axes = (("method", methods), ("data.num_sentences", SIZES), ("seed", SUBSET_SEEDS))
  return c
