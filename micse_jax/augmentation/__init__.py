"""Second-view constructions of miCSE's relatives (Attention-Driven Dropout, MLM and span masking).

Each function is pure, jit-able and keeps static shapes: it maps a batch (or
its arrays) to a new one, never editing the contrastive inputs in place.
"""
from micse_jax.augmentation.add import (
    attention_rollout,
    drop_least_attended,
    num_tokens_to_drop,
    token_importance_naive,
    token_importance_rollout,
)
from micse_jax.augmentation.masking import mlm_mask, span_mask, span_mask_text
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
