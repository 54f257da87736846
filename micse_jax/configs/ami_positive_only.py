"""Positive-only training with AMI (miCSE Tab. 4, App. E): where AMI's regularising effect
shows most."""
from micse_jax.configs import positive_only


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  c = positive_only.get_config(arg)
  c.ami.enabled = True
  return c
