"""Second-view constructions of miCSE's relatives (Attention-Driven Dropout, MLM and span masking).

Each function is pure, jit-able and keeps static shapes: it maps a batch (or
its arrays) to a new one, never editing the contrastive inputs in place.
"""
from micse_jax.augmentation.add import attention_rollout
from micse_jax.augmentation.add import drop_least_attended
from micse_jax.augmentation.add import num_tokens_to_drop
from micse_jax.augmentation.add import token_importance_naive
from micse_jax.augmentation.add import token_importance_rollout
from micse_jax.augmentation.masking import mlm_mask
from micse_jax.augmentation.masking import span_mask
from micse_jax.augmentation.masking import span_mask_text
from micse_jax.augmentation.special_tokens import special_token_mask

__all__ = [
    'attention_rollout',
    'drop_least_attended',
    'mlm_mask',
    'num_tokens_to_drop',
    'span_mask',
    'span_mask_text',
    'special_token_mask',
    'token_importance_naive',
    'token_importance_rollout',
]
