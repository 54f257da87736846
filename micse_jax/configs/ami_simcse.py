"""SimCSE + AMI regulariser (no momentum encoder, no queue)."""
from micse_jax.configs import default


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  c = default.get_config(arg)
  c.momentum.enabled = False
  return c
