"""SimCSE + AMI regulariser (no momentum encoder, no queue)."""
from configs import default


def get_config(arg=None):
  c = default.get_config(arg)
  c.momentum.enabled = False
  return c
