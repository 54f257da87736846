"""Where a population's members live on the devices (`population_mesh`): when the devices divide the
members, the member axis is split over a `member` mesh axis and each device trains whole members
under `shard_map` (members exchange nothing: no collective in the step; GSPMD alone would all-gather
AMI's batched top-k); otherwise every member is data-parallel over all devices (the member axis
replicated, rows split as in a solo run). The stacked state, batch and per-member arrays are placed
accordingly; the population's state and step are `training/population.py`'s.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from micse_jax.training import data_parallel

MEMBER_AXIS = "member"


def spreads_members(k: int, num_devices: int) -> bool:
  """Whether K members are split over the devices (each device trains whole members)."""
  return num_devices > 1 and k % num_devices == 0


def row_devices(k: int, num_devices: int) -> int:
  """The devices one run's rows are split over, the multiple its batch is padded to
  (`data_parallel.padded_batch_size`): all of them for a solo run (k = 0) or data-parallel members, one where
  the members are spread (each device steps whole members: padding 50 sentences to 56 for 8 devices
  would add an eighth of each member's work)."""
  return 1 if k and spreads_members(k, num_devices) else num_devices


def population_mesh(k: int, devices=None) -> Mesh:
  """A 1-D mesh: axis `MEMBER_AXIS` when the devices divide the K members, else `DATA_AXIS`."""
  devices = np.asarray(jax.devices() if devices is None else devices)
  return Mesh(devices, (MEMBER_AXIS if spreads_members(k, devices.size) else data_parallel.DATA_AXIS,))


def spreads_over(mesh: Mesh) -> bool:
  """Whether `mesh` spreads the members (its axis is `MEMBER_AXIS`): each device trains whole members."""
  return mesh.axis_names == (MEMBER_AXIS,)


def state_sharding(abstract, mesh: Mesh):
  """Every stacked leaf split on its member axis (spread), or replicated (data-parallel members)."""
  split = member_sharding(mesh)
  return abstract.replace(step=NamedSharding(mesh, P()), members=jax.tree.map(lambda _: split, abstract.members),
                         stopped_at=split)


def batch_sharding(mesh: Mesh, chunked: bool = False) -> NamedSharding:
  """The stacked packed batch `[K, rows, columns]` (`chunked`: a call's `[steps, K, rows, columns]`):
  split by member, or by rows inside each member."""
  spec = (MEMBER_AXIS,) if spreads_over(mesh) else (None, data_parallel.DATA_AXIS)
  return NamedSharding(mesh, P(*((None,) if chunked else ()), *spec))


def member_sharding(mesh: Mesh) -> NamedSharding:
  """Per-member arrays `[K, ...]` (`stopped_at`, the step inputs, the metrics): split by member, or replicated."""
  return NamedSharding(mesh, P(MEMBER_AXIS) if spreads_over(mesh) else P())


def stacked_batch(packed, mesh: Mesh):
  """A call's chunk, the members' packed batches of each step stacked (`[steps, K, rows, columns]`),
  placed on `mesh`."""
  if jax.process_count() == 1:
    return jax.device_put(packed, batch_sharding(mesh, chunked=True))
  raise NotImplementedError("population training runs on one host")  # checked by the trainer


def inner_mesh(mesh: Mesh) -> Mesh | None:
  """The mesh a member's own step sees: none when members are spread (each device steps whole
  members), else the data mesh its rows are split over."""
  return None if spreads_over(mesh) else mesh
