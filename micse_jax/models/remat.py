"""Rematerialisation of BERT layers (`model.remat`): activation memory traded for recomputation.

"none" keeps every activation for the backward pass. "layer" wraps each `BertLayer` in
`nn.remat` with `dots_with_no_batch_dims_saveable`: the outputs of the dense matmuls (Q/K/V,
attention output, FFN in/out) are kept, the rest (attention scores and softmax, GELU,
LayerNorm, dropout masks) is recomputed. "full" uses `nothing_saveable`: only the layer's
input is kept and the whole layer runs again in the backward pass (least memory, one more
forward). The function computed, the parameter tree and the RNG streams are unchanged; the
sown attention maps are outputs of the remat'd layer, so AMI still reads them.
"""
from __future__ import annotations

import flax.linen as nn
import jax

REMAT_POLICIES = {
    "none": None,
    "layer": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def remat_layer(layer_cls: type[nn.Module], remat: str) -> type[nn.Module]:
  """`layer_cls`, or it wrapped in `nn.remat` with the policy named by `remat`.

  The layer's `__call__(self, x, key_mask, deterministic)`: `deterministic` (argument 3,
  `self` counting as 0) is a Python bool, hence static.
  """
  if remat not in REMAT_POLICIES:
    raise ValueError(f"unsupported remat {remat!r}; expected one of {sorted(REMAT_POLICIES)}")
  if remat == "none":
    return layer_cls
  return nn.remat(layer_cls, policy=REMAT_POLICIES[remat], static_argnums=(3,))
