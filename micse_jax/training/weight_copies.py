"""Half-precision copies of the Dense kernels, kept in the train state: cast once per update, not per forward.

With `model.dtype` bfloat16 or float16 every Dense layer multiplies by its kernel cast to that
dtype (`nn.Dense(dtype=...)`, `bert.fused_dense`); the parameters stay float32 (`precision.py`).
Cast inside the step, that is one GPU kernel per weight and forward — XLA fuses no narrowing cast
into a Triton GEMM — 77 of a BERT-base miCSE step's kernels (the two-view forward and the
momentum encoder's; `BENCHMARKS.md`, kernel diet). Cast where the weights change instead, in the
update's own pass over the weights (`training/update.py`), and the forwards read the copies:

  copies_{t+1} = cast(θ_{t+1}),  copies of the EMA weights likewise     (`of`)
  forward_t reads copies_t = cast(θ_t): the values the in-step cast gives, bit for bit (`substituted`)

The gradient reaches the float32 parameter as through the cast (`_as_copy`: the cotangent cast to
the parameter's dtype), so gradients, loss scaling and the optimizer see what they saw before.
The copies are derived: checkpoints leave them out and a restore rebuilds them, for every state
that holds them, by the state's own methods (`TrainState.without_copies` / `with_copies`, and a
`PopulationState`'s members through them; `dropped`, `rebuilt`), so a workdir's layout is the same
with and without them.

The BERT encoders have copies: the online encoder `params["encoder"]`, CT's second encoder
`params["encoder_b"]` (`COPIED`) and the EMA encoder; their kernels are all read at the compute
dtype. The rest is cast in the step, where that costs a few kernels: the MLP heads (one Dense
each), the MLM head (one transform Dense; its decoder reuses the embedding matrix), InfoCSE's
auxiliary layers and its frozen lower half (an InfoCSE-only path, not the miCSE step the copies
were made for). With float32 compute there is nothing to copy.
"""
from __future__ import annotations

import functools
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp

KERNEL = "kernel"  # the leaf name of a Dense layer's weight matrix (flax)
HALF_DTYPES = (jnp.bfloat16, jnp.float16)
COPIED = ("encoder", "encoder_b")  # the BERT encoders in `params` (besides the EMA encoder) with copies
EMA = "ema"  # the EMA encoder's copies


def kernel_copies(tree, dtype):
  """`tree` with each Dense kernel cast to `dtype` and every other leaf None."""
  def copy(path, leaf):
    return leaf.astype(dtype) if getattr(path[-1], "key", None) == KERNEL else None
  return jax.tree_util.tree_map_with_path(copy, tree)


def of(params: dict, ema_params, dtype) -> dict:
  """The copies of a state's weights for compute `dtype`: {} unless it is a half-precision dtype."""
  if dtype is None or jnp.dtype(dtype) not in map(jnp.dtype, HALF_DTYPES):
    return {}
  copies = {name: kernel_copies(params[name], dtype) for name in COPIED if name in params}
  return dict(copies, **{EMA: kernel_copies(ema_params, dtype)})


def dtype_of(copies: dict):
  """The dtype the copies hold (None without copies)."""
  leaves = jax.tree.leaves(copies)
  return leaves[0].dtype if leaves else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _as_copy(param, copy, param_dtype):
  """`copy` (= param cast to the compute dtype) in place of `param`; the gradient as the cast's."""
  del param, param_dtype
  return copy


def _as_copy_forward(param, copy, param_dtype):
  del param, param_dtype
  return copy, None


def _as_copy_backward(param_dtype, _, cotangent):
  return cotangent.astype(param_dtype), None


_as_copy.defvjp(_as_copy_forward, _as_copy_backward)


def read_through(params: dict, copies: dict) -> dict:
  """`params` with each encoder of `COPIED` read through its copies (`substituted`)."""
  return dict(params, **{name: substituted(params[name], copies[name]) for name in COPIED if name in copies})


def substituted(tree, copies):
  """`tree` with each leaf that has a copy read as that copy (differentiable w.r.t. `tree`)."""
  if not copies:
    return tree
  return jax.tree.map(lambda leaf, copy: leaf if copy is None else _as_copy(leaf, copy, leaf.dtype),
                      tree, copies, is_leaf=lambda v: v is None)


@runtime_checkable
class HoldsCopies(Protocol):
  """A state that holds copies (`TrainState`; `PopulationState`, through its members): it says
  itself what it is without them and how they are rebuilt."""

  def without_copies(self):
    """The state without its copies."""

  def with_copies(self, like):
    """A restored state with the copies `like` (its abstract state) holds."""


def dropped(state):
  """`state` without its copies: what a checkpoint holds. A state that holds copies (`HoldsCopies`)
  drops its own; any other tree (a dict of arrays) holds none."""
  return state.without_copies() if isinstance(state, HoldsCopies) else state


def rebuilt(state, abstract_state):
  """A restored `state` with the copies `abstract_state` has (`HoldsCopies.with_copies`); any other
  tree as it is."""
  return state.with_copies(abstract_state) if isinstance(state, HoldsCopies) else state


def rebuilt_copies(params: dict, ema_params, wanted: dict) -> dict:
  """The copies of `params` and `ema_params` that `wanted` describes (abstract copies: their dtype
  and shardings; also stacked members'); {} when it holds none."""
  if not wanted:
    return {}
  copies = of(params, ema_params, dtype_of(wanted))
  place = lambda copy, like: copy if getattr(like, "sharding", None) is None else jax.device_put(copy, like.sharding)
  return jax.tree.map(place, copies, wanted)
