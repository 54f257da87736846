"""AMI on top of Mirror-BERT (miCSE Tab. 2)."""
from configs import mirror


def get_config(arg=None):
  c = mirror.get_config(arg)
  c.ami.enabled = True
  return c
