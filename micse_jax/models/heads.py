"""The train-time MLP pooler of SimCSE/miCSE: dense + tanh on the [CLS] state.

SimCSE (Gao et al., 2021, §3) trains with this MLP on top of [CLS] and evaluates with the raw
[CLS] state ("cls_before_pooler"). It is a fresh layer (not BERT's NSP pooler) initialised like
BERT's dense layers.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp


class MLPHead(nn.Module):
  """h = tanh(W·[CLS] + b), W ~ N(0, initializer_range²): SimCSE's train-time pooler (§3)."""

  hidden_size: int
  initializer_range: float = 0.02
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, cls_hidden: jax.Array) -> jax.Array:
    init = nn.initializers.normal(stddev=self.initializer_range)
    return jnp.tanh(nn.Dense(self.hidden_size, kernel_init=init, dtype=self.dtype, name="dense")(cls_hidden))
