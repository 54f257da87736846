"""Momentum encoder (miCSE §2.1/§3.1, MoCo): target ← m·target + (1−m)·online after each step."""
import optax


def ema_update(online, target, decay: float):
  """One tree-wide EMA step (optax.incremental_update; step_size = 1 − decay)."""
  return optax.incremental_update(online, target, step_size=1.0 - decay)
