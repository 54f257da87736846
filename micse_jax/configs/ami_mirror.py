"""AMI on top of Mirror-BERT (miCSE Tab. 2)."""
from micse_jax.configs import mirror


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  c = mirror.get_config(arg)
  c.ami.enabled = True
  return c
