"""AdamW with linear warm-up then linear decay to zero (HF Trainer's schedule, as SimCSE)."""
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


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW on `learning_rate_schedule`, after global-norm clipping when `optim.grad_clip_norm` > 0."""
  o = config.optim
  adamw = optax.adamw(learning_rate_schedule(config), b1=o.b1, b2=o.b2, eps=o.eps,
                      weight_decay=o.weight_decay)
  if o.grad_clip_norm and o.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), adamw)
  return adamw
