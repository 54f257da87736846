"""Training objectives: InfoNCE (miCSE Eq. 2), attention mutual information (Eq. 3-5), and the
relatives' terms in their own modules (mlm, reconstruction, alignment)."""
from micse_jax.losses.ami import AMIResult
from micse_jax.losses.ami import ami_loss
from micse_jax.losses.ami import attention_mutual_information
from micse_jax.losses.ami import fold_layer_parity
from micse_jax.losses.ami import mi_from_samples
from micse_jax.losses.ami import official_ami_loss
from micse_jax.losses.ami import official_attention_mutual_information
from micse_jax.losses.ami import sample_cells
from micse_jax.losses.ami import slice_attention
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
