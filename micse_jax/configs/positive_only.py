"""Positive-only training (miCSE Tab. 4, App. E): two dropout views, the alignment term only,
no negatives."""
from micse_jax.configs import methods, simcse


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  _, demo = methods.parse_variant(arg, ())
  c = simcse.get_config(demo)
  c.loss.objective = "positive_only"
  return c
