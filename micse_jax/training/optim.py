"""AdamW with linear warm-up then linear decay to zero (HF Trainer's schedule, as SimCSE), after
global-norm clipping; and the previous release's flat layout of its state, read only.

The optimizer state is optax's own per-leaf state of `make_optimizer` (clip_by_global_norm → adamw:
`mu` and `nu` mirror the parameter tree). The step does not call its `update`: the update runs as
one fused pass over the train state (`training/update.py`, the same optax formulas) with `adamw`
and `clip_norm` as its inputs.

Older layouts, converted when a workdir resumes (`training/program.legacy_layouts`):
  * the previous release ran clipping + AdamW over one flat buffer: its state (`FlatState`) holds
    `mu` and `nu` as one float32 vector each, every trainable leaf raveled (`ravel_pytree` order)
    and zero-padded to a multiple of `FLAT_ALIGN`; `from_flat` gives this per-leaf state back;
  * releases before it saved this per-leaf state already (with the queue as loose fields).
"""
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.flatten_util import ravel_pytree

FLAT_ALIGN = 4096  # elements; the previous layout's flat buffer length is a multiple of this


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warm-up over `optim.warmup_steps` to `optim.learning_rate`, then linear decay to 0 at `num_train_steps`."""
  o = config.optim
  warmup = min(o.warmup_steps, config.num_train_steps)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, o.learning_rate, warmup),
       optax.linear_schedule(o.learning_rate, 0.0, max(config.num_train_steps - warmup, 1))],
      boundaries=[warmup])


def adamw(config: ml_collections.ConfigDict, schedule: optax.Schedule) -> optax.GradientTransformation:
  """`optax.adamw` of `config.optim` on `schedule` (Loshchilov & Hutter 2019: m ← b1·m + (1−b1)·g,
  v ← b2·v + (1−b2)·g², θ ← θ − η_t·(m̂/(√v̂+ε) + λ·θ)): the elementwise part of the update."""
  o = config.optim
  return optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)


def clip_norm(config: ml_collections.ConfigDict) -> float | None:
  """The global-norm clipping threshold c (g ← g·min(1, c/‖g‖₂)), or None when `optim.grad_clip_norm` is 0."""
  c = config.optim.grad_clip_norm
  return float(c) if c and c > 0 else None


def make_optimizer(config: ml_collections.ConfigDict,
                   schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
  """clip_by_global_norm → `adamw` on `schedule` (default `learning_rate_schedule`), as optax chains
  them: its `init` gives the train state's optimizer state, its `update` is what the step's fused
  update computes (`training/update.py`)."""
  inner, c = adamw(config, learning_rate_schedule(config) if schedule is None else schedule), clip_norm(config)
  return inner if c is None else optax.chain(optax.clip_by_global_norm(c), inner)


# ---------------------------------------------------------------- the previous release's flat layout


class FlatState(NamedTuple):
  """The previous layout: the optimizer's state over the flat, padded parameter vector."""
  inner_state: Any


def flat_size(num_elements: int) -> int:
  """The padded length of the previous layout's flat buffer for `num_elements` parameters."""
  return -(-num_elements // FLAT_ALIGN) * FLAT_ALIGN


def _map_state(node, fn):
  """`fn` applied to every parameter tree of an optax state (params are mappings, optax states
  tuples / NamedTuples), everything else (counts, empty states) kept."""
  if isinstance(node, Mapping):
    return fn(node)
  if isinstance(node, tuple):
    parts = [_map_state(n, fn) for n in node]
    return type(node)(*parts) if hasattr(node, "_fields") else tuple(parts)
  return node


def to_flat(opt_state) -> FlatState:
  """A `make_optimizer` state in the previous layout: each moment tree raveled into one float32
  vector, zero-padded to `flat_size` (its shapes say what such a checkpoint holds)."""
  def flatten(tree):
    vector = ravel_pytree(tree)[0].astype(jnp.float32)
    return jnp.pad(vector, (0, flat_size(vector.size) - vector.size))
  return FlatState(_map_state(opt_state, flatten))


def from_flat(flat_state: FlatState, params):
  """`to_flat`'s inverse: the previous layout's state → the `make_optimizer` state of `params`
  (shapes suffice). Counts are kept; the padding, zero by construction, is dropped."""
  leaves, tree = jax.tree.flatten(params)
  sizes = [math.prod(leaf.shape) for leaf in leaves]
  size, starts = sum(sizes), [sum(sizes[:i]) for i in range(len(sizes))]

  def unravel(vector):  # `ravel_pytree`'s order: the leaves in tree order, each raveled
    return tree.unflatten([vector[a:a + n].reshape(leaf.shape) for a, n, leaf in zip(starts, sizes, leaves)])

  def convert(node):
    if isinstance(node, tuple):
      parts = [convert(n) for n in node]
      return type(node)(*parts) if hasattr(node, "_fields") else tuple(parts)
    if getattr(node, "ndim", 0) == 1 and node.shape[0] == flat_size(size):
      return unravel(node[:size])
    return node
  return convert(flat_state.inner_state)
