"""AMI on top of Contrastive Tension (miCSE Tab. 2): AMI between the two encoders' attention."""
from micse_jax.configs import ct


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  c = ct.get_config(arg)
  c.ami.enabled = True
  return c
