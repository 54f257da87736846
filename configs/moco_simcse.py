"""SimCSE + momentum encoder and negative queue (no AMI)."""
from configs import default


def get_config(arg=None):
  c = default.get_config(arg)
  c.ami.enabled = False
  return c
