"""Mirror-BERT (Liu et al., EMNLP 2021): the second view is the sentence with a random span
masked (plus dropout on both views); InfoNCE with in-batch negatives."""
from configs import default, methods


def get_config(arg=None):
  _, demo = methods.parse_variant(arg, ())
  c = default.get_config(demo)
  c.ami.enabled = False
  c.momentum.enabled = False
  c.view.kind = "span_mask"
  return c
