"""Mirror-BERT (Liu et al., EMNLP 2021): the second view is the sentence with a random span
masked (plus dropout on both views); InfoNCE with in-batch negatives."""
from micse_jax.configs import methods, simcse


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  _, demo = methods.parse_variant(arg, ())
  c = simcse.get_config(demo)
  c.view.kind = "span_mask"
  return c
