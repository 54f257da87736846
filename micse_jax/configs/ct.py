"""Contrastive Tension (Carlsson et al., ICLR 2021), in-batch form: two independent encoders
from the same checkpoint; the positive of a sentence is its encoding by the other encoder."""
from micse_jax.configs import methods, simcse


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  _, demo = methods.parse_variant(arg, ())
  c = simcse.get_config(demo)
  c.ct.enabled = True
  return c
