"""Training objectives: InfoNCE (miCSE Eq. 2), attention mutual information (Eq. 3-5), and the
relatives' terms in their own modules (mlm, reconstruction, alignment)."""
from micse_jax.losses.ami import (
    AMIResult,
    ami_loss,
    attention_mutual_information,
    fold_layer_parity,
    mi_from_samples,
    sample_cells,
    slice_attention,
)
from micse_jax.losses.ami_official import official_ami_loss, official_attention_mutual_information
from micse_jax.losses.infonce import info_nce_loss

__all__ = [
    'AMIResult',
    'ami_loss',
    'attention_mutual_information',
    'fold_layer_parity',
    'info_nce_loss',
    'mi_from_samples',
    'official_ami_loss',
    'official_attention_mutual_information',
    'sample_cells',
    'slice_attention',
]
