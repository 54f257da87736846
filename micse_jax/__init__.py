"""micse_jax: miCSE (attention mutual-information regularised SimCSE) in JAX/Flax."""
from micse_jax.encoder import SentenceEncoder

__all__ = ["SentenceEncoder"]
__version__ = "0.1.0"
