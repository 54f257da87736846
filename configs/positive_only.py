"""Positive-only training (miCSE Tab. 4, App. E): two dropout views, the alignment term only,
no negatives."""
from configs import default, methods


def get_config(arg=None):
  _, demo = methods.parse_variant(arg, ())
  c = default.get_config(demo)
  c.ami.enabled = False
  c.momentum.enabled = False
  c.loss.objective = "positive_only"
  return c
