"""AdamW with linear warm-up then linear decay to zero (HF Trainer's schedule, as SimCSE), run over
one flat buffer.

The optimizer state does not mirror the ~200 parameter leaves: `flat` ravels the gradient (and the
params) into one float32 vector, padded with zeros to a multiple of `FLAT_ALIGN`, and runs the
inner `clip_by_global_norm` → AdamW chain on it, so the clipping norm is one reduction and AdamW one
elementwise pass; the updates are unravelled back to the parameter tree (XLA fuses the per-leaf
`params + updates` horizontally). The padding is zero in every moment and update (a zero gradient and
a zero parameter give a zero AdamW step), keeps the norm exact, and lets FSDP (`mesh.leaf_partition`)
split the moments over any power-of-two device count up to `FLAT_ALIGN`. Params and the EMA keep
their per-leaf layout (checkpoint names, export and the model are unchanged).
"""
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.flatten_util import ravel_pytree

FLAT_ALIGN = 4096  # elements; the flat buffer's length is a multiple of this


class FlatState(NamedTuple):
  """The inner transformation's state over the flat, padded parameter vector."""
  inner_state: Any


def flat_size(num_elements: int) -> int:
  """The padded length of the flat buffer for `num_elements` parameters."""
  return -(-num_elements // FLAT_ALIGN) * FLAT_ALIGN


def flatten(tree) -> jax.Array:
  """The tree's leaves as one float32 vector (`ravel_pytree` order), zero-padded to `flat_size`."""
  vector = ravel_pytree(tree)[0].astype(jnp.float32)
  return jnp.pad(vector, (0, flat_size(vector.size) - vector.size))


def all_finite(tree) -> jax.Array:
  """Whether every leaf of `tree` is finite: one reduction over `flatten(tree)`, not one per leaf."""
  return jnp.all(jnp.isfinite(flatten(tree)))


def global_grad_norm(grads) -> jax.Array:
  """‖g‖₂ over all leaves, as one reduction over `flatten(grads)` (the clipping norm; XLA shares it)."""
  return optax.global_norm(flatten(grads))


def flat(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` run on `flatten(updates)` (like `optax.flatten`, plus the `FLAT_ALIGN` padding)."""
  def init(params):
    return FlatState(inner.init(flatten(params)))

  def update(updates, state, params=None):
    vector, unravel = ravel_pytree(updates)
    flat_params = None if params is None else flatten(params)
    new, inner_state = inner.update(flatten(updates), state.inner_state, flat_params)
    return unravel(new[:vector.size]), FlatState(inner_state)

  return optax.GradientTransformation(init, update)


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warm-up over `optim.warmup_steps` to `optim.learning_rate`, then linear decay to 0 at `num_train_steps`."""
  o = config.optim
  warmup = min(o.warmup_steps, config.num_train_steps)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, o.learning_rate, warmup),
       optax.linear_schedule(o.learning_rate, 0.0, max(config.num_train_steps - warmup, 1))],
      boundaries=[warmup])


def per_leaf_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW (Loshchilov & Hutter 2019: m ← b1·m + (1−b1)·g, v ← b2·v + (1−b2)·g², θ ← θ − η_t·(m̂/(√v̂+ε) + λ·θ))
  on `learning_rate_schedule`, after global-norm clipping (g ← g·min(1, c/‖g‖₂)) when `optim.grad_clip_norm` > 0.

  Per-leaf state: the layout of checkpoints written before the flat optimizer (`legacy_to_flat`)."""
  o = config.optim
  adamw = optax.adamw(learning_rate_schedule(config), b1=o.b1, b2=o.b2, eps=o.eps,
                      weight_decay=o.weight_decay)
  if o.grad_clip_norm and o.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), adamw)
  return adamw


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The training optimizer: `per_leaf_optimizer`'s clipping + AdamW over one flat buffer (`flat`)."""
  return flat(per_leaf_optimizer(config))


def legacy_to_flat(opt_state):
  """A per-leaf `per_leaf_optimizer` state (older checkpoints) → the `make_optimizer` state.

  Every state leaf that is a parameter tree (AdamW's mu and nu) is flattened; counts are kept."""
  def convert(node):
    if isinstance(node, Mapping):  # a parameter tree (params are mappings; optax states are tuples)
      return flatten(node)
    if isinstance(node, tuple):
      return type(node)(*map(convert, node)) if hasattr(node, "_fields") else tuple(map(convert, node))
    return node
  return FlatState(convert(opt_state))
