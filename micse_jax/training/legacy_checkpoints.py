"""Workdirs of older releases: their train-state layouts and the conversion to this one, in one place.

`checkpoint.resume` restores a checkpoint on the program's abstract state; when that fails it
tries the layouts `layouts(program)` lists, in order, restores the checkpoint in the one that
reads and converts it (one warning line). The layouts:

  * the previous release's: clipping + AdamW ran over one flat buffer, so its optimizer state
    (`FlatState`) holds `mu` and `nu` as one float32 vector each, every trainable leaf raveled
    (`ravel_pytree` order) and zero-padded to a multiple of `FLAT_ALIGN` (`to_flat`, read back
    by `from_flat`); solo runs and populations, and a population's that also saved its members'
    half-precision weight copies (dropped on conversion: a restore rebuilds them);
  * a solo run's releases before it: this per-leaf optimizer state, the queue as four loose
    top-level fields (`as_loose_fields`, read back by `from_loose_fields`).

Any other layout is refused in one line (`checkpoint.check_layout`). Nothing here is part of a
step: the train step, its state and the optimizer know only the current layout.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from micse_jax.training import population_placement, state_placement, weight_copies
from micse_jax.training.momentum import Queue
from micse_jax.training.state import TrainState

if TYPE_CHECKING:
  from micse_jax.training.program import Program

FLAT_ALIGN = 4096  # elements; the previous layout's flat buffer length is a multiple of this
LOOSE_QUEUE_FIELDS = {"queue": "embeddings", "queue_valid": "valid", "queue_ptr": "ptr", "queue_ids": "ids"}


@dataclasses.dataclass(frozen=True)
class Legacy:
  """An older train-state layout a checkpoint may hold: what it is (for the warning line), its
  abstract state (with shardings) and `convert`, old state → current state (without the
  half-precision copies: the restore rebuilds them)."""
  name: str
  abstract_state: Any
  convert: Callable[[Any], Any]


def layouts(program: Program) -> tuple[Legacy, ...]:
  """The older layouts a checkpoint of `program` may hold, in the order a restore tries them."""
  if program.members:
    dropped = weight_copies.dropped(program.abstract_state).members
    found = [_population_flat(program, dropped)]
    copies = program.abstract_state.members.compute_weights
    if copies:
      old = {name: copies[name] for name in ("encoder", weight_copies.EMA)}
      found.append(_population_flat(program, dropped.replace(compute_weights=old)))
    return tuple(found)
  return _solo_layouts(program)


def _solo_layouts(program: Program) -> tuple[Legacy, Legacy]:
  """A solo run's flat optimizer state, and its releases' before it (the queue as loose fields)."""
  dropped, params, c = weight_copies.dropped(program.abstract_state), program.abstract_params[0], program.config
  target = weight_copies.dropped(program.state_sharding)
  flat = jax.eval_shape(lambda s: s.replace(opt_state=to_flat(s.opt_state)), dropped)
  to_per_leaf = jax.jit(lambda s: s.replace(opt_state=from_flat(s.opt_state, params)), out_shardings=target)
  from_fields = jax.jit(from_loose_fields, out_shardings=target)
  solo = lambda old: state_placement.placed(
      old, state_placement.state_sharding(old, program.mesh, c.mesh.shard_state, c.mesh.shard_min_elements))
  return (Legacy("flat optimizer state", solo(flat), to_per_leaf),
          Legacy("the queue as loose fields", solo(as_loose_fields(dropped)), from_fields))


def _population_flat(program: Program, members) -> Legacy:
  """A population's previous layout: each member's optimizer state flat, its `members` fields
  otherwise as given (with saved copies: dropped on conversion)."""
  params = program.abstract_params[0]
  old = program.abstract_state.replace(members=members.replace(
      opt_state=jax.eval_shape(jax.vmap(to_flat), members.opt_state)))

  def convert(state):
    opt_state = jax.vmap(lambda s: from_flat(s, params))(state.members.opt_state)
    return state.replace(members=state.members.replace(opt_state=opt_state, compute_weights={}))
  name = "flat optimizer state" + (", the members' weight copies saved" if members.compute_weights else "")
  return Legacy(name, state_placement.placed(old, population_placement.state_sharding(old, program.mesh)),
                jax.jit(convert, out_shardings=weight_copies.dropped(program.state_sharding)))


# ---------------------------------------------------------------- the previous release's flat optimizer state


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
  """An `optim.make_optimizer` state in the previous layout: each moment tree raveled into one
  float32 vector, zero-padded to `flat_size` (its shapes say what such a checkpoint holds)."""
  def flatten(tree):
    vector = ravel_pytree(tree)[0].astype(jnp.float32)
    return jnp.pad(vector, (0, flat_size(vector.size) - vector.size))
  return FlatState(_map_state(opt_state, flatten))


def from_flat(flat_state: FlatState, params):
  """`to_flat`'s inverse: the previous layout's state → the `optim.make_optimizer` state of `params`
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


# ---------------------------------------------------------------- the queue as loose fields


def as_loose_fields(state: TrainState) -> dict:
  """The state laid out as releases before the `Queue` struct saved it: a dict of the fields, the
  queue as four loose top-level entries (`{}` each without momentum)."""
  fields = {name: getattr(state, name) for name in ("step", "params", "ema_params", "opt_state", "rng",
                                                    "loss_scale", "frozen_params")}
  queue = {old: ({} if state.queue is None else getattr(state.queue, new)) for old, new in LOOSE_QUEUE_FIELDS.items()}
  return {**fields, **queue}


def from_loose_fields(fields: dict) -> TrainState:
  """`as_loose_fields`' inverse."""
  has_queue = not isinstance(fields["queue"], dict)
  queue = Queue(**{new: fields[old] for old, new in LOOSE_QUEUE_FIELDS.items()}) if has_queue else None
  return TrainState(step=fields["step"], params=fields["params"], ema_params=fields["ema_params"],
                    opt_state=fields["opt_state"], queue=queue, rng=fields["rng"],
                    loss_scale=fields["loss_scale"], frozen_params=fields["frozen_params"])
