"""The update as one pass over the train state: clipping, AdamW, the EMA, the half-precision copies
and the keep-or-stop mask, reading each leaf's g, θ, m, v, θ̄ once and writing θ, m, v, θ̄ and copies.

Per parameter leaf θ with gradient g, Adam moments m, v and step count t (AdamW: Loshchilov & Hutter
2019, "Decoupled Weight Decay Regularization", Alg. 2 — computed by `optax.adamw` itself, so bias
correction and ε sit where optax puts them), after global-norm clipping (Pascanu et al. 2013):

  ĝ = g                  if ‖g‖₂ < c, else (g / ‖g‖₂)·c        (`optax.clip_by_global_norm`)
  m ← β1·m + (1−β1)·ĝ,   v ← β2·v + (1−β2)·ĝ²,   t ← t + 1
  θ ← θ − η_t·( (m/(1−β1^t)) / (√(v/(1−β2^t)) + ε) + λ·θ )
  θ̄ ← μ·θ̄ + (1−μ)·θ     (the momentum encoder's EMA, miCSE §2.1, `momentum.ema_update`)
  copies ← cast(θ), cast(θ̄)   (`weight_copies.py`)

and θ, m, v, t, θ̄ and the copies all stay as they were where `keep` is false, and with `skip_nonfinite`
where ‖g‖₂ is not finite (which steps apply no update: the non-finite policy, `training/non_finite.py`).

Why it moves few bytes in few kernels on a GPU (deviceless H100 compiles; figures in BENCHMARKS.md):

* ‖g‖² is one variadic reduction per distinct leaf shape (`global_norm`): XLA rewrites a sum over a
  concatenation into one reduction (one or two kernels) per leaf;
* each leaf's update is elementwise, so XLA fuses it into one loop fusion per leaf; leaves of the same
  shape are merged into one multi-output fusion because they share a non-scalar operand — the norm and
  the keep flag, read from one vector behind an optimization barrier (`_shared`); XLA's sibling fusion
  ignores shared scalars, and XLA's GPU pipeline no longer has a horizontal loop fusion, so without
  it every bias and LayerNorm leaf is a kernel of its own;
* nothing is concatenated or selected over the whole state afterwards.

The optimizer state is optax's own per-leaf state of `optim.make_optimizer` (= clip_by_global_norm →
adamw); the train step passes its `optim.adamw` and `optim.clip_norm` (`training/step.py`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from micse_jax.models.column_sums import variadic_sum
from micse_jax.training import weight_copies
from micse_jax.training.momentum import ema_update


class Result(NamedTuple):
  """What `apply` returns: the new trees, ‖g‖₂ (before clipping) and whether the update was applied."""
  params: Any
  opt_state: Any
  ema_params: Any
  copies: dict
  grad_norm: jax.Array
  applied: jax.Array


def global_norm(tree) -> jax.Array:
  """‖g‖₂ over all leaves, as `optax.tree.norm` (per-leaf sums of squares added in leaf order), with the
  leaves of one shape and dtype summed by one variadic reduction (`column_sums.variadic_sum`: a few
  kernels instead of ~2 per leaf)."""
  leaves = jax.tree.leaves(tree)
  groups: dict[tuple, list[int]] = {}
  for i, leaf in enumerate(leaves):
    groups.setdefault((leaf.shape, leaf.dtype), []).append(i)
  sums = [None] * len(leaves)
  for (shape, _), members in groups.items():
    squares = tuple(jnp.square(leaves[i]) for i in members)
    reduced = [jnp.sum(squares[0])] if len(members) == 1 else variadic_sum(squares, tuple(range(len(shape))))
    for i, s in zip(members, reduced):
      sums[i] = s
  total = 0
  for s in sums:
    total = total + s
  return jnp.sqrt(jnp.asarray(total))


def _shared(*scalars: jax.Array) -> list[jax.Array]:
  """`scalars` (the norm, the keep flag, the update's scale) read back from one float32 vector behind an
  optimization barrier, so that every leaf's fusion reads the same non-scalar operand: what XLA's
  sibling multi-output fusion needs to merge same-shaped leaves into one kernel (it does not count
  shared scalars). Exact: float32 values and a 0/1 flag, no arithmetic."""
  vector = jax.lax.optimization_barrier(jnp.stack([jnp.asarray(x, jnp.float32) for x in scalars]))
  return [vector[i] for i in range(len(scalars))]


def clipped(grads, norm: jax.Array, max_norm: float):
  """`optax.clip_by_global_norm(max_norm)`'s update given the norm: g where ‖g‖₂ < c, else (g/‖g‖₂)·c."""
  trigger = norm < max_norm
  return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads)


def where(keep: jax.Array, new, old):
  """`new` where `keep`, else `old`, leaf by leaf."""
  return jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inputs:
  """What one update (`apply`) reads, by name."""
  inner: optax.GradientTransformation  # the elementwise part (AdamW: `optim.adamw`)
  grads: Any
  params: Any
  opt_state: Any                       # the state of chain(clip_by_global_norm(max_norm), inner), or inner's
  max_norm: float | None               # the clipping threshold c (`optim.clip_norm`); None: no clipping
  ema_params: Any = None               # the EMA encoder θ̄, following params["encoder"] with `ema_decay`
  ema_decay: float | None = None       # μ (None: no EMA)
  copies: dict | None = None           # the half-precision copies (`weight_copies.of`), recast from the new weights
  keep: Any = True                     # a traced bool or True: where false, everything stays as it was
  skip_nonfinite: bool = False         # also keep everything where ‖g‖₂ is not finite
  scale: jax.Array | None = None       # a float32 scalar multiplying `inner`'s updates


def transformation(inner: optax.GradientTransformation, max_norm: float | None) -> optax.GradientTransformation:
  """The transformation `apply` runs on the optimizer state: `inner` as `optim.make_optimizer` chains it
  after clipping, with the clipping itself left to `apply` (`clipped`, from the norm it shares). The
  clipping's state is optax's empty state, as the identity's, so this chain's state is the optimizer's
  (the checkpointed layout) and is passed through whole, no part of it picked out by position."""
  return inner if max_norm is None else optax.chain(optax.identity(), inner)


def apply(u: Inputs) -> Result:
  """One fused update (see the module docstring) of `u.params` and `u.opt_state` (the state of
  `optax.chain(clip_by_global_norm(max_norm), inner)`, or of `inner` when `max_norm` is None) by
  `u.grads`; `inner` must be elementwise per leaf (AdamW is). `scale` multiplies `inner`'s updates (a
  population member's peak learning rate on a schedule that peaks at 1). With `ema_decay`,
  `ema_params` follows `params["encoder"]`; `copies` (`weight_copies.of`) are recast from the new weights.

  `keep` (a traced bool or True) leaves everything as it was where false; with `skip_nonfinite` a
  non-finite ‖g‖₂ does too (`applied` says which). A finite norm and a finite state give a finite
  new state: ĝ is finite (|ĝ_i| ≤ ‖g‖₂), m and v are convex combinations of finite values, and
  |m̂|/√v̂ is bounded by a constant of β1, β2 alone (Cauchy–Schwarz over m's history, as β1² < β2;
  about 7.3 for 0.9, 0.999; an overflowing v̂ gives a zero step), so θ moves by a finite step: no
  check of the new params is needed, short of θ itself reaching float32's range.
  """
  norm = global_norm(u.grads)
  keep = jnp.asarray(u.keep, bool)
  if u.skip_nonfinite:
    keep = keep & jnp.isfinite(norm)
  shared = _shared(norm, keep, *(() if u.scale is None else (u.scale,)))
  shared_norm, shared_keep = shared[0], shared[1] != 0
  grads = u.grads if u.max_norm is None else clipped(u.grads, shared_norm, u.max_norm)
  updates, new_state = transformation(u.inner, u.max_norm).update(grads, u.opt_state, u.params)
  if u.scale is not None:
    updates = jax.tree.map(lambda x: x * shared[2].astype(x.dtype), updates)
  new_params = where(shared_keep, optax.apply_updates(u.params, updates), u.params)
  new_state = where(shared_keep, new_state, u.opt_state)
  new_ema = u.ema_params
  if u.ema_decay is not None and u.ema_params:
    new_ema = where(shared_keep, ema_update(new_params["encoder"], u.ema_params, u.ema_decay), u.ema_params)
  new_copies = u.copies
  if u.copies:
    new_copies = weight_copies.of(new_params, new_ema, weight_copies.dtype_of(u.copies))
  return Result(new_params, new_state, new_ema, new_copies, norm, keep)


WRITTEN = ("params", "opt_state", "ema_params", "compute_weights")  # the train-state fields `apply` writes
# (the rest of a skipped step's state is kept by `non_finite.rest_kept`)

