"""Population training: K runs that differ only in their per-member fields, trained by one jitted step.

Member i is the solo run of `configs/population_fields.member_config(config, i)` (its seed: MLP-head
init, dropout / AMI / momentum keys and data order; its few-shot subset; its learning rate and AMI
weight, which the step takes as arrays: `configs/population_fields.PER_MEMBER`).

The members' train states (whatever the `TrainState` pytree holds) are stacked on a leading
member axis (`stack`) inside one `PopulationState`, and the pure step of `training/step.py` is
`jax.vmap`ped over it (`make_population_step`; built and jitted by `training/program.py`):
member i's update is the solo run's update, to float32 rounding. A member whose loss or gradient
norm is not finite is stopped alone (the non-finite policy, `training/non_finite.py`): from that step
on its state is kept as it was (`stopped_at[i]` = the step), the others go on. The update keeps a stopped member's params,
moments, EMA and copies in its own pass (`training/update.py`: no select over the stacked state);
only the rest of its state (step, queue, loss scale) is selected.

Where the members live on the devices is `training/population_placement.py`'s.
"""
from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from micse_jax.data.packing import BatchLayout
from micse_jax.training import non_finite, population_placement
from micse_jax.training.non_finite import STOPPED
from micse_jax.training.population_placement import MEMBER_AXIS


@flax.struct.dataclass
class PopulationState:
  """The population's train state: one pytree, checkpointed whole.

  step: int32 scalar, population steps taken == the data position of every member still training.
  members: the members' train states stacked on a leading axis of size K.
  stopped_at: int32 [K], the step at which a member went non-finite (`STOPPED` while it trains).
  """
  step: jax.Array
  members: Any
  stopped_at: jax.Array

  def without_copies(self) -> "PopulationState":
    """The state a checkpoint holds: every member without its half-precision weight copies."""
    return self.replace(members=self.members.without_copies())

  def with_copies(self, like: "PopulationState") -> "PopulationState":
    """A restored state with every member's copies rebuilt as `like` (its abstract state) holds them."""
    return self.replace(members=self.members.with_copies(like.members))


# ---------------------------------------------------------------- state



def stack(trees):
  """One pytree with a leading member axis from K pytrees of the same structure (host arrays)."""
  return jax.tree.map(lambda *x: np.stack([np.asarray(v) for v in x]), *trees)


def member(tree, index: int):
  """Member `index`'s slice of a stacked pytree."""
  return jax.tree.map(lambda x: x[index], tree)


def initial_state(member_states) -> PopulationState:
  """Step 0 of a population from its members' step-0 train states (host arrays)."""
  k = len(member_states)
  return PopulationState(step=np.zeros((), np.int32), members=stack(member_states),
                         stopped_at=np.full((k,), STOPPED, np.int32))


def abstract_state(abstract_member, k: int) -> PopulationState:
  """`jax.eval_shape`-style shapes of a K-member population from one member's shapes."""
  grow = lambda s: jax.ShapeDtypeStruct((k,) + tuple(s.shape), s.dtype)
  return PopulationState(step=jax.ShapeDtypeStruct((), jnp.int32), members=jax.tree.map(grow, abstract_member),
                         stopped_at=jax.ShapeDtypeStruct((k,), jnp.int32))


# ---------------------------------------------------------------- the step


def member_step_fn(step_fn: Callable, layout: BatchLayout) -> Callable:
  """One member's masked step: (state, packed batch, stopped_at, hyper) → (state, metrics, went_bad);
  `step_fn(state, batch, hyper, alive)` is the pure train step (`training/step.py`).

  A member that trains and stays finite takes `step_fn`'s new state (unchanged, bit for bit); a
  stopped one, or one whose loss or gradient norm is not finite, keeps its state (the non-finite
  policy, `training/non_finite.py`: the update keeps params, moments, EMA and copies itself, the
  member's `alive` flag passed into it; `non_finite.member_kept` the rest).
  """
  def masked(state, packed, stopped_at, member_hyper):
    alive = stopped_at == STOPPED
    new, metrics = step_fn(state, layout.unpack(packed), member_hyper, alive)
    kept, bad = non_finite.member_kept(alive, new, state, metrics)
    return kept, metrics, bad
  return masked


def make_population_step(step_fn: Callable, layout: BatchLayout, mesh: Mesh | None = None) -> Callable:
  """The pure population step (PopulationState, packed [K, rows, cols], hyper) → (PopulationState,
  metrics [K]) of the members' pure train step `step_fn` (built on `population_placement.inner_mesh(mesh)`);
  `hyper` holds the per-member step inputs (arrays [K], `configs/population_fields.step_inputs`)."""
  member_step = member_step_fn(step_fn, layout)
  members_step = _one_member_unbatched(jax.vmap(member_step), member_step)
  if mesh is not None and population_placement.spreads_over(mesh):
    # Each device steps its own members: nothing crosses devices. Every input and output is split by
    # member, so there is no replication for the check to track; unchecked, the members' program may
    # hold Pallas calls (the dropout-attention kernels), whose outputs carry no varying-axes annotation.
    members_step = jax.shard_map(members_step, mesh=mesh, in_specs=P(MEMBER_AXIS), out_specs=P(MEMBER_AXIS),
                                 check_vma=False)

  def population_step(pstate: PopulationState, packed, hyper):
    members, metrics, bad = members_step(pstate.members, packed, pstate.stopped_at, hyper)
    stopped_at = non_finite.stopped_after(pstate.stopped_at, bad, pstate.step)
    return PopulationState(step=pstate.step + 1, members=members, stopped_at=stopped_at), metrics

  return population_step


def _one_member_unbatched(batched: Callable, single: Callable) -> Callable:
  """`batched` (the vmapped member step), but where a program steps one member (a population spread
  one member per device, or K = 1) the member step itself on that member, its axis dropped and put
  back: the solo step's program, where `vmap` would cost the forward its fused normalisations (XLA's
  Triton softmax/norm fusions do not take the batched LayerNorm; BENCHMARKS.md has the times). The
  same values (the member's own step either way)."""
  def step(*args):
    if jax.tree.leaves(args)[0].shape[0] != 1:  # the member count here (per device under shard_map): static
      return batched(*args)
    out = single(*jax.tree.map(lambda x: x[0], args))
    return jax.tree.map(lambda x: x[None], out)
  return step


# ---------------------------------------------------------------- reporting


def member_metrics(metrics: dict, index: int) -> dict[str, float]:
  """Member `index`'s scalars from the step's per-member metrics (host floats)."""
  return {k: float(np.asarray(v)[index]) for k, v in metrics.items()}
