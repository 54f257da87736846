"""miCSE: SimCSE + attention mutual information (AMI) + momentum encoder with a negative queue."""
from micse_jax.configs import default


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  return default.get_config(arg)
