"""Unsupervised SimCSE: InfoNCE over two dropout views, in-batch negatives only."""
from configs import default


def get_config(arg=None):
  c = default.get_config(arg)
  c.ami.enabled = False
  c.momentum.enabled = False
  return c
