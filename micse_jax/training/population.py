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

Placement (`population_mesh`): when the devices divide the members, the member axis is split
over a `member` mesh axis and each device trains whole members under `shard_map` (members
exchange nothing: no collective in the step; GSPMD alone would all-gather AMI's batched top-k);
otherwise every member is data-parallel over all devices (the member
axis replicated, rows split as in a solo run).
"""
from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from micse_jax.data.packing import BatchLayout
from micse_jax.training import data_parallel, non_finite
from micse_jax.training.non_finite import STOPPED

MEMBER_AXIS = "member"


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


# ---------------------------------------------------------------- placement


def spreads_members(k: int, num_devices: int) -> bool:
  """Whether K members are split over the devices (each device trains whole members)."""
  return num_devices > 1 and k % num_devices == 0


def row_devices(k: int, num_devices: int) -> int:
  """The devices one run's rows are split over, the multiple its batch is padded to
  (`mesh.padded_batch_size`): all of them for a solo run (k = 0) or data-parallel members, one where
  the members are spread (each device steps whole members: padding 50 sentences to 56 for 8 devices
  would add an eighth of each member's work)."""
  return 1 if k and spreads_members(k, num_devices) else num_devices


def population_mesh(k: int, devices=None) -> Mesh:
  """A 1-D mesh: axis `MEMBER_AXIS` when the devices divide the K members, else `DATA_AXIS`."""
  devices = np.asarray(jax.devices() if devices is None else devices)
  return Mesh(devices, (MEMBER_AXIS if spreads_members(k, devices.size) else data_parallel.DATA_AXIS,))


def _spread(mesh: Mesh) -> bool:
  return mesh.axis_names == (MEMBER_AXIS,)


def state_sharding(abstract: PopulationState, mesh: Mesh):
  """Every stacked leaf split on its member axis (spread), or replicated (data-parallel members)."""
  split = member_sharding(mesh)
  return PopulationState(step=NamedSharding(mesh, P()), members=jax.tree.map(lambda _: split, abstract.members),
                         stopped_at=split)


def batch_sharding(mesh: Mesh, chunked: bool = False) -> NamedSharding:
  """The stacked packed batch `[K, rows, columns]` (`chunked`: a call's `[steps, K, rows, columns]`):
  split by member, or by rows inside each member."""
  spec = (MEMBER_AXIS,) if _spread(mesh) else (None, data_parallel.DATA_AXIS)
  return NamedSharding(mesh, P(*((None,) if chunked else ()), *spec))


def member_sharding(mesh: Mesh) -> NamedSharding:
  """Per-member arrays `[K, ...]` (`stopped_at`, the step inputs, the metrics): split by member, or replicated."""
  return NamedSharding(mesh, P(MEMBER_AXIS) if _spread(mesh) else P())


def stacked_batch(packed, mesh: Mesh):
  """A call's chunk, the members' packed batches of each step stacked (`[steps, K, rows, columns]`),
  placed on `mesh`."""
  if jax.process_count() == 1:
    return jax.device_put(packed, batch_sharding(mesh, chunked=True))
  raise NotImplementedError("population training runs on one host")  # checked by the trainer


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
  metrics [K]) of the members' pure train step `step_fn` (built on `inner_mesh(mesh)`); `hyper`
  holds the per-member step inputs (arrays [K], `configs/population_fields.step_inputs`)."""
  member_step = member_step_fn(step_fn, layout)
  members_step = _one_member_unbatched(jax.vmap(member_step), member_step)
  if mesh is not None and _spread(mesh):  # each device steps its own members: nothing crosses devices
    # Every input and output is split by member, so there is no replication for the check to track;
    # unchecked, the members' program may hold Pallas calls (the dropout-attention kernels), whose
    # outputs carry no varying-axes annotation.
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


def inner_mesh(mesh: Mesh) -> Mesh | None:
  """The mesh a member's own step sees: none when members are spread (each device steps whole
  members), else the data mesh its rows are split over."""
  return None if _spread(mesh) else mesh


# ---------------------------------------------------------------- reporting


def member_metrics(metrics: dict, index: int) -> dict[str, float]:
  """Member `index`'s scalars from the step's per-member metrics (host floats)."""
  return {k: float(np.asarray(v)[index]) for k, v in metrics.items()}
