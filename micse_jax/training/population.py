"""Population training (issue 27): K runs that differ only in their seeds, trained by one jitted step.

`population.seeds = (s_0, ..., s_{K-1})` makes member i the solo run of the same config with
`seed = s_i` (its MLP-head init, dropout / AMI / momentum keys and data order) and, with
`population.subset_seeds` / `population.num_sentences`, its own few-shot subset
(`data.subset_seed`, `data.num_sentences`): `member_config(config, i)` is that solo config.

The members' train states (whatever the `TrainState` pytree holds) are stacked on a leading
member axis (`stack`) inside one `PopulationState`, and the pure step of `training/step.py` is
`jax.vmap`ped over it (`make_population_step`): member i's update is the solo run's update, to
float32 rounding. A member whose loss, gradient norm or new params are not finite is stopped
alone: from that step on its state is kept as it was (`stopped_at[i]` = the step), the others go on.

Placement (`population_mesh`): when the devices divide the members, the member axis is split
over a `member` mesh axis and each device trains whole members under `shard_map` (members
exchange nothing: no collective in the step; GSPMD alone would all-gather AMI's batched top-k);
otherwise every member is data-parallel over all devices (the member
axis replicated, rows split as in a solo run).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from micse_jax.data.packing import BatchLayout
from micse_jax.errors import ConfigError
from micse_jax.training import mesh as mesh_lib
from micse_jax.training import optim
from micse_jax.training.step import make_train_step

MEMBER_AXIS = "member"
STOPPED = -1  # `stopped_at` of a member that trains
# A config.json written before population training existed lacks these; absent means this value.
FIELD_DEFAULTS = {"population.seeds": [], "population.subset_seeds": [], "population.num_sentences": 0,
                  "population.learning_rates": [], "population.ami_weights": []}


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


# ---------------------------------------------------------------- config


def enabled(config: ml_collections.ConfigDict) -> bool:
  """Whether `config` asks for population training (`population.seeds` not empty)."""
  return bool(config.get("population", {}).get("seeds", ()))


def size(config: ml_collections.ConfigDict) -> int:
  """K, the number of members (0 without population training)."""
  return len(config.population.seeds) if enabled(config) else 0


def _int_tuple(value) -> bool:
  return isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                  for v in value)


def _check_per_member(values, k: int, name: str, what: str, ok) -> None:
  """One finite number per member passing `ok`, or none; ConfigError (one line) otherwise."""
  if values and (len(values) != k or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                             and math.isfinite(v) and ok(v) for v in values)):
    raise ConfigError(f"{name} must give one finite {what} per member ({k}), or none; got {values!r}")


def check_config(config: ml_collections.ConfigDict) -> None:
  """The `population.*` fields and what they combine with; ConfigError (one line) otherwise."""
  if "population" not in config:
    return
  p = config.population
  if not _int_tuple(p.seeds) or len(set(p.seeds)) != len(p.seeds):
    raise ConfigError(f"population.seeds must be a tuple of distinct integers >= 0, e.g. '(1,2,3)'; got {p.seeds!r}")
  if not _int_tuple(p.subset_seeds):
    raise ConfigError(f"population.subset_seeds must be a tuple of integers >= 0; got {p.subset_seeds!r}")
  if not (isinstance(p.num_sentences, int) and not isinstance(p.num_sentences, bool) and p.num_sentences >= 0):
    raise ConfigError(f"population.num_sentences must be an integer >= 0, got {p.num_sentences!r}")
  if not p.seeds:
    if p.subset_seeds or p.num_sentences:
      raise ConfigError("population.subset_seeds / population.num_sentences need population.seeds")
    return
  if p.subset_seeds and len(p.subset_seeds) != len(p.seeds):
    raise ConfigError(f"population.subset_seeds has {len(p.subset_seeds)} entries, population.seeds "
                      f"{len(p.seeds)}: give one subset seed per member (or none)")
  _check_per_member(p.get("learning_rates", ()), len(p.seeds), "population.learning_rates", "learning rate > 0",
                    lambda r: r > 0)
  weights = p.get("ami_weights", ())
  _check_per_member(weights, len(p.seeds), "population.ami_weights", "AMI weight >= 0", lambda w: w >= 0)
  if weights and not config.ami.enabled:
    raise ConfigError("population.ami_weights needs ami.enabled=True")
  if config.mesh.shard_state:
    raise ConfigError("population training keeps every member's state whole; mesh.shard_state=True is "
                      "not supported with population.seeds")


def member_config(config: ml_collections.ConfigDict, index: int) -> ml_collections.ConfigDict:
  """Member `index`'s solo config: `seed` (and subset) of the member, no population fields set."""
  p = config.population
  member = ml_collections.ConfigDict(config.to_dict())
  member.seed = int(p.seeds[index])
  if p.subset_seeds:
    member.data.subset_seed = int(p.subset_seeds[index])
  if p.num_sentences:
    member.data.num_sentences = int(p.num_sentences)
  if p.get("learning_rates", ()):
    member.optim.learning_rate = float(p.learning_rates[index])
  member.population.seeds, member.population.subset_seeds, member.population.num_sentences = (), (), 0
  if p.get("ami_weights", ()):
    member.ami.weight = float(p.ami_weights[index])
  member.population.learning_rates, member.population.ami_weights = (), ()
  return member


def member_configs(config: ml_collections.ConfigDict) -> list[ml_collections.ConfigDict]:
  """The K members' solo configs, in the order of `population.seeds`."""
  return [member_config(config, i) for i in range(size(config))]


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


def population_mesh(k: int, devices=None) -> Mesh:
  """A 1-D mesh: axis `MEMBER_AXIS` when the devices divide the K members, else `DATA_AXIS`."""
  devices = np.asarray(jax.devices() if devices is None else devices)
  return Mesh(devices, (MEMBER_AXIS if spreads_members(k, devices.size) else mesh_lib.DATA_AXIS,))


def _spread(mesh: Mesh) -> bool:
  return mesh.axis_names == (MEMBER_AXIS,)


def state_sharding(abstract: PopulationState, mesh: Mesh):
  """Every stacked leaf split on its member axis (spread), or replicated (data-parallel members)."""
  split = NamedSharding(mesh, P(MEMBER_AXIS) if _spread(mesh) else P())
  return PopulationState(step=NamedSharding(mesh, P()), members=jax.tree.map(lambda _: split, abstract.members),
                         stopped_at=split)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """The stacked packed batch `[K, rows, columns]`: split by member, or by rows inside each member."""
  return NamedSharding(mesh, P(MEMBER_AXIS) if _spread(mesh) else P(None, mesh_lib.DATA_AXIS))


def stacked_batch(member_batches, layout: BatchLayout, step: int, mesh: Mesh):
  """Step `step`'s batches of every member (`TrainBatches`), packed, stacked and placed on `mesh`."""
  packed = np.stack([layout.pack(b.batch(step)) for b in member_batches])
  if jax.process_count() == 1:
    return jax.device_put(packed, batch_sharding(mesh))
  raise NotImplementedError("population training runs on one host")  # checked by the trainer


# ---------------------------------------------------------------- the step


def optimizer_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config the shared optimizer and schedule are built from: member 0's; with per-member
  `population.learning_rates`, its `optim.learning_rate` is 1 (the schedule's shape) and each
  member's peak multiplies its updates (`hyper`), so other rates need no other program."""
  shared = member_config(config, 0)
  if config.population.get("learning_rates", ()):
    shared.optim.learning_rate = 1.0
  return shared


def hyper(config: ml_collections.ConfigDict) -> dict:
  """The per-member hyper-parameters the step takes as an argument (`{}` when none differ):
  `lr_peak` (`population.learning_rates`), `ami_weight` (`population.ami_weights`)."""
  p, out = config.population, {}
  if p.get("learning_rates", ()):
    out["lr_peak"] = np.asarray(p.learning_rates, np.float32)
  if p.get("ami_weights", ()):
    out["ami_weight"] = np.asarray(p.ami_weights, np.float32)
  return out


def _with_ami_weight(config: ml_collections.ConfigDict, weight) -> ml_collections.ConfigDict:
  """`config` with `ami.weight` a traced per-member scalar (the AMI term only multiplies by it)."""
  traced = ml_collections.ConfigDict(config.to_dict(), type_safe=False)
  traced.ami.weight = weight
  return traced


def _scaled(tx, schedule, peak):
  """`tx` and `schedule` of a unit peak learning rate, scaled by `peak` (a traced scalar)."""
  import optax

  def update(updates, opt_state, params=None):
    updates, opt_state = tx.update(updates, opt_state, params)
    return jax.tree.map(lambda u: u * peak.astype(u.dtype), updates), opt_state

  return optax.GradientTransformation(tx.init, update), lambda step: schedule(step) * peak


def member_step_fn(make_step: Callable, layout: BatchLayout) -> Callable:
  """One member's masked step: (state, packed batch, stopped_at, hyper) → (state, metrics, went_bad);
  `make_step(hyper)` is the member's pure train step.

  A member that trains and stays finite takes `step_fn`'s new state (unchanged, bit for bit);
  a stopped one, or one whose loss, gradient norm or new params are not finite, keeps its state.
  A float16 step the loss scale skipped (`step_skipped`) is no failure (its update was not applied).
  """
  def masked(state, packed, stopped_at, member_hyper):
    new, metrics = make_step(member_hyper)(state, layout.unpack(packed))
    applied = metrics.get("step_skipped", jnp.asarray(0)) == 0
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]) & optim.all_finite(new.params)
    bad = applied & ~finite
    keep_new = (stopped_at == STOPPED) & ~bad
    kept = jax.tree.map(lambda n, o: jnp.where(keep_new, n, o), new, state)
    return kept, metrics, bad
  return masked


def make_population_step(config: ml_collections.ConfigDict, nets, tx, schedule, layout: BatchLayout,
                         mesh: Mesh | None = None) -> Callable:
  """The pure population step (PopulationState, packed [K, rows, cols], hyper) → (PopulationState,
  metrics [K]); `hyper` is `hyper(config)` (per-member arrays, placed like `stopped_at`).

  `config`, `tx`, `schedule` are `optimizer_config`'s (members differ only in what their states,
  batches and `hyper` hold). On a data-parallel `mesh` each member's rows are split as in a solo
  run (`make_train_step`'s mesh).
  """
  inner_mesh = None if mesh is None or _spread(mesh) else mesh

  def make_step(member_hyper):
    member = _with_ami_weight(config, member_hyper["ami_weight"]) if "ami_weight" in member_hyper else config
    if "lr_peak" not in member_hyper:
      return make_train_step(member, nets, tx, schedule, inner_mesh)
    return make_train_step(member, nets, *_scaled(tx, schedule, member_hyper["lr_peak"]), inner_mesh)

  members_step = jax.vmap(member_step_fn(make_step, layout))
  if mesh is not None and _spread(mesh):  # each device steps its own members: nothing crosses devices
    members_step = jax.shard_map(members_step, mesh=mesh, in_specs=P(MEMBER_AXIS), out_specs=P(MEMBER_AXIS))

  def population_step(pstate: PopulationState, packed, member_hyper):
    members, metrics, bad = members_step(pstate.members, packed, pstate.stopped_at, member_hyper)
    newly = (pstate.stopped_at == STOPPED) & bad
    stopped_at = jnp.where(newly, pstate.step, pstate.stopped_at).astype(jnp.int32)
    return PopulationState(step=pstate.step + 1, members=members, stopped_at=stopped_at), metrics

  return population_step


def jit_population_step(config, nets, tx, schedule, layout: BatchLayout, mesh: Mesh, sharding: PopulationState):
  """`make_population_step` jitted over `mesh`: state on `sharding` (donated), metrics per member."""
  step = make_population_step(config, nets, tx, schedule, layout, mesh)
  metrics_sharding = NamedSharding(mesh, P(MEMBER_AXIS) if _spread(mesh) else P())
  return jax.jit(step, in_shardings=(sharding, batch_sharding(mesh), metrics_sharding),
                 out_shardings=(sharding, metrics_sharding), donate_argnums=0)


# ---------------------------------------------------------------- reporting


def newly_stopped(stopped_at, reported: set[int]) -> list[tuple[int, int]]:
  """(member, step) of members stopped and not yet in `reported` (which this adds them to)."""
  found = [(i, int(s)) for i, s in enumerate(np.asarray(stopped_at)) if s != STOPPED and i not in reported]
  reported.update(i for i, _ in found)
  return found


def stopped_line(index: int, seed: int, step: int, alive: int) -> str:
  """The one line that reports a member stopped for a non-finite update."""
  return (f"population member {index} (seed {seed}) stopped: non-finite loss, gradient or params at step {step}; "
          f"its state is kept as before that step, {alive} member(s) go on (lower optim.learning_rate?)")


def member_metrics(metrics: dict, index: int) -> dict[str, float]:
  """Member `index`'s scalars from the step's per-member metrics (host floats)."""
  return {k: float(np.asarray(v)[index]) for k, v in metrics.items()}
