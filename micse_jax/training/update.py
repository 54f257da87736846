"""The update as one pass over the train state: clipping, AdamW, the EMA, the half-precision copies
and the keep-or-stop mask, reading each leaf's g, θ, m, v, θ̄ once and writing θ, m, v, θ̄ and copies.

Per parameter leaf θ with gradient g, Adam moments m, v and step count t (AdamW: Loshchilov & Hutter
2019, "Decoupled Weight Decay Regularization", Alg. 2 — computed by `optax.adamw` itself, so bias
correction and ε sit where optax puts them), after global-norm clipping (Pascanu et al. 2013):

  ĝ = g                  if ‖g‖₂ < c, else (g / ‖g‖₂)·c        (`optax.clip_by_global_norm`)
  m ← β1·m + (1−β1)·ĝ,   v ← β2·v + (1−β2)·ĝ²,   t ← t + 1
  θ ← θ − η_t·( (m/(1−β1^t)) / (√(v/(1−β2^t)) + ε) + λ·θ )
  θ̄ ← μ·θ̄ + (1−μ)·θ     (the momentum encoder's EMA, miCSE §2.1, `momentum.ema_update`)
  copies ← cast(θ), cast(θ̄)   (`compute_weights.py`)

and θ, m, v, t, θ̄ and the copies all stay as they were where `keep` is false (a stopped population
member; with `skip_nonfinite`, a step whose gradient norm is not finite, as float16 loss scaling skips).

Why it moves few bytes in few kernels on a GPU (deviceless H100 compiles; figures in BENCHMARKS.md):

* ‖g‖² is one variadic reduction per distinct leaf shape (`global_norm`): XLA rewrites a sum over a
  concatenation into one reduction (one or two kernels) per leaf;
* each leaf's update is elementwise, so XLA fuses it into one loop fusion per leaf; leaves of the same
  shape are merged into one multi-output fusion because they share a non-scalar operand — the norm and
  the keep flag, read from one vector behind an optimization barrier (`_shared`); XLA's sibling fusion
  ignores shared scalars, and XLA's GPU pipeline no longer has a horizontal loop fusion, so without
  it every bias and LayerNorm leaf is a kernel of its own;
* nothing is concatenated or selected over the whole state afterwards.

The optimizer state is optax's own per-leaf state of `optimizer(config)` (= clip_by_global_norm →
adamw), the layout older releases checkpointed; the flat layout (`optim.FlatState`) converts with
`from_flat`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.flatten_util import ravel_pytree

from micse_jax.training import compute_weights
from micse_jax.training.momentum import ema_update


class Result(NamedTuple):
  """What `apply` returns: the new trees, ‖g‖₂ (before clipping) and whether the update was applied."""
  params: Any
  opt_state: Any
  ema_params: Any
  copies: dict
  grad_norm: jax.Array
  applied: jax.Array


def adamw(config: ml_collections.ConfigDict, schedule: optax.Schedule) -> optax.GradientTransformation:
  """`optax.adamw` of `config.optim` on `schedule`: the elementwise part of the update."""
  o = config.optim
  return optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)


def clip_norm(config: ml_collections.ConfigDict) -> float | None:
  """The clipping threshold c, or None when `optim.grad_clip_norm` is 0 (no clipping)."""
  c = config.optim.grad_clip_norm
  return float(c) if c and c > 0 else None


def optimizer(config: ml_collections.ConfigDict, schedule: optax.Schedule) -> optax.GradientTransformation:
  """clip_by_global_norm → `adamw` as optax chains them: its `init` gives the state `apply` updates, and
  its `update` is the per-leaf reference `apply` equals."""
  c = clip_norm(config)
  inner = adamw(config, schedule)
  return inner if c is None else optax.chain(optax.clip_by_global_norm(c), inner)


def global_norm(tree) -> jax.Array:
  """‖g‖₂ over all leaves, as `optax.tree.norm` (per-leaf sums of squares added in leaf order), with the
  leaves of one shape and dtype summed by one variadic reduction (a few kernels instead of ~2 per leaf)."""
  leaves = jax.tree.leaves(tree)
  groups: dict[tuple, list[int]] = {}
  for i, leaf in enumerate(leaves):
    groups.setdefault((leaf.shape, leaf.dtype), []).append(i)
  sums = [None] * len(leaves)
  for (shape, dtype), members in groups.items():
    squares = [jnp.square(leaves[i]) for i in members]
    if len(members) == 1:
      reduced = [jnp.sum(squares[0])]
    else:
      zeros = [jnp.zeros((), dtype)] * len(members)
      reduced = jax.lax.reduce(squares, zeros, _add_pairwise, tuple(range(len(shape))))
    for i, s in zip(members, reduced):
      sums[i] = s
  total = 0
  for s in sums:
    total = total + s
  return jnp.sqrt(jnp.asarray(total))


def _add_pairwise(a, b):
  return tuple(x + y for x, y in zip(a, b))


def _shared(norm: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(norm, keep) read back from one vector behind an optimization barrier, so that every leaf's
  fusion reads the same non-scalar operand: what XLA's sibling multi-output fusion needs to merge
  same-shaped leaves into one kernel (it does not count shared scalars). Exact: no arithmetic."""
  vector = jax.lax.optimization_barrier(jnp.stack([norm, keep.astype(norm.dtype)]))
  return vector[0], vector[1] != 0


def clipped(grads, norm: jax.Array, max_norm: float):
  """`optax.clip_by_global_norm(max_norm)`'s update given the norm: g where ‖g‖₂ < c, else (g/‖g‖₂)·c."""
  trigger = norm < max_norm
  return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads)


def _where(keep: jax.Array, new, old):
  return jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)


def apply(inner: optax.GradientTransformation, grads, opt_state, params, *, max_norm: float | None,
          ema_params=None, ema_decay: float | None = None, copies: dict | None = None, keep=True,
          skip_nonfinite: bool = False) -> Result:
  """One fused update (see the module docstring) of `params` and `opt_state` (the state of
  `optax.chain(clip_by_global_norm(max_norm), inner)`, or of `inner` when `max_norm` is None) by
  `grads`; `inner` must be elementwise per leaf (AdamW is). With `ema_decay`, `ema_params` follows
  `params["encoder"]`; `copies` (`compute_weights.of`) are recast from the new weights.

  `keep` (a traced bool or True) leaves everything as it was where false; with `skip_nonfinite` a
  non-finite ‖g‖₂ does too (`applied` says which). A finite norm and a finite state give a finite
  new state: ĝ is finite (|ĝ_i| ≤ ‖g‖₂), m and v are convex combinations of finite values, and
  |m̂|/√v̂ is bounded by a constant of β1, β2 alone (Cauchy–Schwarz over m's history, as β1² < β2;
  about 7.3 for 0.9, 0.999; an overflowing v̂ gives a zero step), so θ moves by a finite step: no
  check of the new params is needed, short of θ itself reaching float32's range.
  """
  norm = global_norm(grads)
  keep = jnp.asarray(keep, bool)
  if skip_nonfinite:
    keep = keep & jnp.isfinite(norm)
  shared_norm, shared_keep = _shared(norm, keep)
  inner_state = opt_state if max_norm is None else opt_state[1]
  if max_norm is not None:
    grads = clipped(grads, shared_norm, max_norm)
  updates, new_inner = inner.update(grads, inner_state, params)
  new_params = _where(shared_keep, optax.apply_updates(params, updates), params)
  new_inner = _where(shared_keep, new_inner, inner_state)
  new_state = new_inner if max_norm is None else (opt_state[0], new_inner)
  new_ema = ema_params
  if ema_decay is not None and ema_params:
    new_ema = _where(shared_keep, ema_update(new_params["encoder"], ema_params, ema_decay), ema_params)
  new_copies = copies
  if copies:
    new_copies = compute_weights.of(new_params, new_ema, compute_weights.dtype_of(copies))
  return Result(new_params, new_state, new_ema, new_copies, norm, keep)


# ---------------------------------------------------------------- checkpoint layouts


def _map_state(node, fn):
  """`fn` applied to every parameter-shaped node of an optax state (params are mappings, optax
  states tuples / NamedTuples), everything else (counts, empty states) kept."""
  if isinstance(node, Mapping):
    return fn(node)
  if isinstance(node, tuple):
    parts = [_map_state(n, fn) for n in node]
    return type(node)(*parts) if hasattr(node, "_fields") else tuple(parts)
  return node


def from_flat(flat_state, params):
  """The flat optimizer's state (`optim.FlatState`: mu, nu raveled into one zero-padded vector each)
  → `optimizer`'s per-leaf state, for restoring checkpoints of that layout; `params` gives the tree
  (shapes suffice). Counts are kept; the padding, zero by construction, is dropped."""
  unravel = ravel_pytree(params)[1]
  size = sum(leaf.size for leaf in jax.tree.leaves(params))

  def convert(node):
    if isinstance(node, tuple):
      parts = [convert(n) for n in node]
      return type(node)(*parts) if hasattr(node, "_fields") else tuple(parts)
    if getattr(node, "ndim", 0) == 1 and node.shape[0] >= size:
      return unravel(node[:size])
    return node
  return convert(flat_state.inner_state)


def to_flat(opt_state, pad_to: int):
  """`from_flat`'s inverse (per-leaf mu, nu → one float32 vector each, zero-padded to `pad_to`), for
  tests and for writing the older layout."""
  def flatten(tree):
    vector = ravel_pytree(tree)[0].astype(jnp.float32)
    return jnp.pad(vector, (0, pad_to - vector.size))
  return _map_state(opt_state, flatten)
