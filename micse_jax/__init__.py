"""micse_jax: miCSE (attention mutual-information regularised SimCSE) in JAX/Flax.

`SentenceEncoder` is imported on first use, so that `import micse_jax.<module>` (the CLIs,
configs) does not pay for importing JAX before it needs it.
"""
__all__ = ["SentenceEncoder"]
__version__ = "0.1.0"


def __getattr__(name):
  if name == "SentenceEncoder":
    from micse_jax.encoder import SentenceEncoder
    return SentenceEncoder
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
