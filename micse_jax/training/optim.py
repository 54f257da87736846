"""AdamW with linear warm-up then linear decay to zero (HF Trainer's schedule, as SimCSE), after
global-norm clipping.

The optimizer state is optax's own per-leaf state of `make_optimizer` (clip_by_global_norm → adamw:
`mu` and `nu` mirror the parameter tree). The step does not call its `update`: the update runs as
one fused pass over the train state (`training/update.py`, the same optax formulas) with `adamw`
and `clip_norm` as its inputs.

Older releases laid this state out otherwise; `training/legacy_checkpoints.py` converts their workdirs.
"""
import ml_collections
import optax


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warm-up over `optim.warmup_steps` to `optim.learning_rate`, then linear decay to 0 at `num_train_steps`."""
  o = config.optim
  warmup = min(o.warmup_steps, config.num_train_steps)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, o.learning_rate, warmup),
       optax.linear_schedule(o.learning_rate, 0.0, max(config.num_train_steps - warmup, 1))],
      boundaries=[warmup])


def adamw(config: ml_collections.ConfigDict, schedule: optax.Schedule) -> optax.GradientTransformation:
  """`optax.adamw` of `config.optim` on `schedule` (Loshchilov & Hutter 2019: m ← b1·m + (1−b1)·g,
  v ← b2·v + (1−b2)·g², θ ← θ − η_t·(m̂/(√v̂+ε) + λ·θ)): the elementwise part of the update."""
  o = config.optim
  return optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)


def clip_norm(config: ml_collections.ConfigDict) -> float | None:
  """The global-norm clipping threshold c (g ← g·min(1, c/‖g‖₂)), or None when `optim.grad_clip_norm` is 0."""
  c = config.optim.grad_clip_norm
  return float(c) if c and c > 0 else None


def make_optimizer(config: ml_collections.ConfigDict,
                   schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
  """clip_by_global_norm → `adamw` on `schedule` (default `learning_rate_schedule`), as optax chains
  them: its `init` gives the train state's optimizer state, its `update` is what the step's fused
  update computes (`training/update.py`)."""
  inner, c = adamw(config, learning_rate_schedule(config) if schedule is None else schedule), clip_norm(config)
  return inner if c is None else optax.chain(optax.clip_by_global_norm(c), inner)

