"""The one training program of a config, built and jitted here for a solo run and a population alike.

`build(config, bert_config, encoder, devices)` makes the networks (the only place that builds them
for a run: the step, the step-0 params and the evaluators all use these), the optimizer and
schedule, the abstract train state (`jax.ShapeDtypeStruct`s on their shardings, never
materialised), the batch layout and the jitted, donated step. The trainer, the deviceless
compile (`micse_jax/aot/compile.py`), the scaling analyses and the bench all take the step from
here, so what `bench --aot` counts is the program the trainer runs.

One call runs `steps` training steps (`steps_per_dispatch`, `training/dispatch.py`): a scan over a
stacked chunk of packed batches, each step the one below, so K steps in one call equal K calls bit for
bit (`chunk_loop.repeated`). A solo run's step is `training/step.make_train_step` over a data mesh; its call is
(state, packed `[steps, rows, cols]`, watch) → (state, the last step's metrics, watch), the non-finite
`non_finite.Watch` folded in at every step. A population's (`population.seeds`) vmaps that step over the
stacked members (`training/population.make_population_step`); its call is (PopulationState, packed
`[steps, K, rows, cols]`, hyper) → (state, the last step's metrics `[K]`, stopped_at), `hyper` holding
the members' step inputs (`configs/population_fields.PER_MEMBER`). The batch comes packed in one int32 array
(`data/packing.py`).
`chunk_size` (GradCache's rows per block, `training/grad_cache.py`) is checked against the padded batch and
its devices here, and "auto" resolved once for the devices' memory (`training/chunk_choice.py`: the
program compiled at a few block sizes), so the trainer, a population, the deviceless compile and the bench
all run the number chosen.
The encoder's shapes come from the checkpoint the trainer loaded (`abstract_of`) or, with no
weights at all, from the model's init (`abstract_encoder`); the rest of the params' from the networks.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from micse_jax import config_checks
from micse_jax.configs import population_fields
from micse_jax.data.packing import BatchLayout
from micse_jax.data.pipeline import batch_layout
from micse_jax.kernels import choice
from micse_jax.models.bert import BertConfig, BertModel
from micse_jax.training import (
  chunk_choice,
  chunk_loop,
  data_parallel,
  dispatch,
  kernel_fallback,
  non_finite,
  population,
  population_placement,
  run_inputs,
  state_placement,
  xla_options,
)
from micse_jax.training.networks import Networks, SpecialTokens, build_networks
from micse_jax.training.optim import learning_rate_schedule, make_optimizer
from micse_jax.training.step import make_train_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
  """A config's networks, optimizer, abstract state and shardings, batch layout and jitted step."""
  config: ml_collections.ConfigDict  # what the step is built from (`step_config`)
  nets: Networks
  tx: optax.GradientTransformation  # `optim.make_optimizer`: its init gives the optimizer state
  mesh: Mesh
  members: int                       # 0: a solo run; K: a population of K members
  abstract_params: tuple             # (params, frozen params) of one run, as ShapeDtypeStructs (`run_inputs.initial_params`)
  abstract_state: Any                # ShapeDtypeStructs placed on `state_sharding`
  state_sharding: Any
  layout: BatchLayout
  rows: int                          # global rows of a run's batch (padded to the devices it is split over)
  hyper: dict                        # the members' step inputs, float32 [K] each ({} for a solo run)
  jitted: Callable                   # the jitted, donated call: `step(*program.inputs(state, packed, watch))`
  target: choice.Target              # what it is compiled for: the kernels its layers may take
  rebuild: Callable                  # (target, steps) -> this program for another target or number of steps
  steps: int = 1                     # training steps per call (`steps_per_dispatch` resolved)
  executable: Any = None             # the compiled step, once `compiled` has run

  @property
  def step(self) -> Callable:
    """The step to call: the compiled executable (`compiled`), else the jitted function."""
    return self.jitted if self.executable is None else self.executable

  @property
  def batch_sharding(self):
    """Where a call's packed chunk lives: rows split over the data axis (a population: by member or
    rows), every step of the chunk alike."""
    if self.members:
      return population_placement.batch_sharding(self.mesh, chunked=True)
    return data_parallel.chunk_sharded(self.mesh)

  def abstract_batch(self) -> jax.ShapeDtypeStruct:
    """The packed chunk's shape, placed: `[steps, rows, columns]`, a population's `[steps, K, rows, columns]`."""
    shape = (self.steps,) + ((self.members,) if self.members else ()) + (self.rows, self.layout.columns)
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)

  @functools.cached_property
  def placed_hyper(self) -> dict:
    """`hyper` on the devices (once), split like the members."""
    return jax.device_put(self.hyper, population_placement.member_sharding(self.mesh)) if self.members else {}

  def inputs(self, state, packed, watch=None) -> tuple:
    """The call's arguments: (state, packed, a solo run's `watch` (default: none yet) or a
    population's step inputs)."""
    if self.members:
      return state, packed, self.placed_hyper
    return state, packed, self.fresh_watch() if watch is None else watch

  def run(self, state, packed, watch=None) -> tuple:
    """One call: `steps` steps on the packed chunk → (state, the last step's metrics, health): a solo
    run's `non_finite.Watch` after them (`watch` folded on), a population's `stopped_at`."""
    return self.step(*self.inputs(state, packed, watch))

  def fresh_watch(self) -> non_finite.Watch:
    """A solo run's watch with no non-finite step yet, on the mesh."""
    return jax.device_put(non_finite.Watch.fresh(), data_parallel.replicated(self.mesh))

  @property
  def compiler_options(self) -> dict:
    """The XLA options `compiled` compiles the step with (`xla_options.compiler_options`: by layout,
    target and CUDA graphs)."""
    return xla_options.compiler_options(bool(self.config.mesh.get("shard_state")), self.target.platform,
                                        self.target.devices, self.cuda_graphs)

  @property
  def cuda_graphs(self) -> str | None:
    """What the step's CUDA graphs hold (`mesh.cuda_graphs` resolved for the target:
    `xla_options.cuda_graphs_for`); None off CUDA."""
    if self.target.platform != "cuda":
      return None
    return xla_options.cuda_graphs_for(self.config.mesh.get("cuda_graphs", "auto"), self.target.ampere_or_newer)

  def abstract_inputs(self) -> tuple:
    """The call's arguments as placed `ShapeDtypeStruct`s: (state, chunk, a solo run's watch or a
    population's step inputs); nothing placed, also for absent devices."""
    if self.members:
      on, third = population_placement.member_sharding(self.mesh), self.hyper
    else:
      on, third = data_parallel.replicated(self.mesh), jax.eval_shape(non_finite.Watch.fresh)
    third = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=on), third)
    return self.abstract_state, self.abstract_batch(), third

  def lower(self):
    """The call lowered on its abstract inputs (`abstract_inputs`)."""
    return self.jitted.lower(*self.abstract_inputs())

  def place_batch(self, host_batches: list[dict]):
    """The members' host batches of one step (one for a solo run), packed and placed as a chunk of one
    step (a program of `steps` 1)."""
    return self.place_chunk([host_batches])

  def place_chunk(self, steps_batches: list[list[dict]]):
    """A call's chunk: for each of its `steps` steps, the members' host batches (one for a solo run),
    packed, stacked and placed."""
    if len(steps_batches) != self.steps:
      raise ValueError(f"a chunk of {len(steps_batches)} steps for a program of {self.steps}")
    packed = np.stack([np.stack([self.layout.pack(b) for b in step]) for step in steps_batches])
    if self.members:
      return population_placement.stacked_batch(packed, self.mesh)
    return data_parallel.global_batch(packed[:, 0], self.mesh, self.batch_sharding)

  def with_steps(self, steps: int) -> "Program":
    """This program for another number of steps per call (the chunk plan's shorter one), not compiled."""
    return self if steps == self.steps else self.rebuild(self.target, steps)

  def initial_state(self, runs: list):
    """The placed step-0 state of the prepared runs (`run_inputs.prepare`: the run, or each member): each
    run's checkpoint weights and seed through these networks (`run_inputs.initial_state`)."""
    return self.place_state([run_inputs.initial_state(r.config, self.nets, self.tx, r.encoder_params) for r in runs])

  def place_state(self, member_states: list):
    """The step-0 state from the members' step-0 train states (one for a solo run), placed."""
    state = population.initial_state([jax.device_get(s) for s in member_states]) if self.members else member_states[0]
    return jax.device_put(state, self.state_sharding)


def step_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config the program is built from: a solo run's own; a population's member 0 (members
  differ only in what their states, batches and step inputs hold), with the schedule at peak 1
  when the learning rate is a step input (each member's peak scales its update, `training/step.py`)."""
  if not population_fields.enabled(config):
    return config
  shared = population_fields.member_config(config, 0)
  if "learning_rate" in population_fields.step_inputs(config):
    shared.optim.learning_rate = 1.0
  return shared


def abstract_of(tree):
  """A pytree's shapes and dtypes (`ShapeDtypeStruct`s)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def abstract_encoder(config: ml_collections.ConfigDict, bert_config: BertConfig):
  """The encoder params' shapes without any weights: the model's init, with BERT's MLM head where the
  method reads the checkpoint's (`run_inputs.needs_mlm_head`)."""
  model = BertModel(bert_config, add_mlm_head=run_inputs.needs_mlm_head(config))
  ids = jnp.zeros((1, config.model.max_length), jnp.int32)
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids, jnp.ones_like(ids))["params"])


def build(config: ml_collections.ConfigDict, bert_config: BertConfig, encoder, devices=None,
          tokens: SpecialTokens | None = None, target: choice.Target | None = None,
          steps: int | None = None) -> Program:
  """The program of `config` on `devices` (default: all here; a deviceless target's also work):
  `encoder` holds the shapes of the checkpoint's encoder params (`abstract_of`, `abstract_encoder`),
  `tokens` the checkpoint's special token ids (the views and masks that need them), `target` what
  the kernels are chosen for (default: the devices' own, `kernels/choice.target_of`), `steps` the
  training steps per call (default: `steps_per_dispatch`, `auto` resolved for the target:
  `dispatch.steps_for`)."""
  if chunk_choice.is_auto(config):
    return _with_chunk_chosen(config, bert_config, encoder, devices, tokens, target, steps)
  k, shared = population_fields.size(config), step_config(config)
  devices = jax.devices() if devices is None else list(devices)
  mesh = population_placement.population_mesh(k, devices) if k else data_parallel.data_mesh(devices)
  if target is None:  # the kernels run on the rows of the mesh a member's step sees
    target = choice.target_of(devices, mesh=population_placement.inner_mesh(mesh) if k else mesh)
  shared = _with_state_layout(shared, mesh, target, k)
  nets, tx = build_networks(shared, bert_config, tokens, target), make_optimizer(shared)
  params = jax.eval_shape(lambda e: run_inputs.initial_params(shared, nets, e), encoder)
  member = jax.eval_shape(lambda p: run_inputs.new_train_state(shared, bert_config.hidden_size, tx, *p), params)
  if k:
    abstract = population.abstract_state(member, k)
    sharding = population_placement.state_sharding(abstract, mesh)
  else:
    abstract = member
    sharding = state_placement.state_sharding(member, mesh, shared.mesh.shard_state, shared.mesh.shard_min_elements,
                                       shared.mesh.shard_update)
  if steps is None:  # the arrays a call passes: the state both ways, about as many again besides
    steps = dispatch.steps_for(config, bert_config, target, 2 * len(jax.tree.leaves(abstract)) + 8)
  layout = batch_layout(shared.model.max_length)
  hyper = {name: np.asarray(values, np.float32) for name, values in population_fields.step_inputs(config).items()}
  row_devices = population_placement.row_devices(k, len(devices))
  rows = data_parallel.padded_batch_size(shared.batch_size, row_devices)
  config_checks.check_chunk_size(shared.get("chunk_size", chunk_choice.WHOLE), rows, row_devices)
  return Program(
      config=shared, nets=nets, tx=tx, mesh=mesh, members=k, abstract_params=params,
      abstract_state=state_placement.placed(abstract, sharding), state_sharding=sharding, layout=layout,
      rows=rows, hyper=hyper, jitted=_jitted_step(shared, nets, mesh, sharding, layout, k), target=target,
      rebuild=lambda t, n=None: build(config, bert_config, encoder, devices, tokens, t, steps if n is None else n),
      steps=steps)


def _with_chunk_chosen(config: ml_collections.ConfigDict, bert_config: BertConfig, encoder, devices,
                       tokens: SpecialTokens | None, target: choice.Target | None, steps: int | None) -> Program:
  """`build` of `config` with `chunk_size=auto` resolved (`chunk_choice.resolve`): each block size tried is
  the program built at that size and compiled (`compiled`), its peak the compiler's; the program of the
  size chosen is returned (compiled where it was tried), its config and `rebuild` holding the number."""
  devices = jax.devices() if devices is None else list(devices)
  row_devices = population_placement.row_devices(population_fields.size(config), len(devices))
  rows = data_parallel.padded_batch_size(config.batch_size, row_devices)
  tried = {}

  def at(size: int) -> Program:
    fixed = config.copy_and_resolve_references()
    fixed.chunk_size = chunk_choice.WHOLE if size == rows else str(size)
    return build(fixed, bert_config, encoder, devices, tokens, target, steps)

  def peak_of(size: int) -> tuple[int, int]:
    tried[size] = compiled(at(size))
    m = chunk_choice.compiled_memory(tried[size].executable)  # the compiler's figures, as `bench --aot` reports them
    return m["peak"], m["arguments"] + m["outputs"] - m["aliased"]

  # this process's device: every host reads its own GPU's limit (another host's device has no stats here)
  local = next((d for d in devices if d.process_index == jax.process_index()), devices[0])
  size = int(chunk_choice.resolve(config, rows, row_devices, local, peak_of)) or rows
  return tried[size] if size in tried else at(size)


def _with_state_layout(config: ml_collections.ConfigDict, mesh: Mesh, target: choice.Target,
                       members: int) -> ml_collections.ConfigDict:
  """`config` with `mesh.shard_state` decided (`state_placement.shards_state`: an unset field chosen for the
  devices), so the step, the shardings and the checkpoints read one value."""
  chosen = state_placement.shards_state(config.mesh, mesh.size, target.platform, members)
  if config.mesh.get("shard_state") == chosen:
    return config
  if chosen:
    logging.info("mesh.shard_state unset: the train state is sharded over the %d devices (FSDP, the faster "
                 "step on several GPUs); --config.mesh.shard_state=False keeps it replicated", mesh.size)
  config = config.copy_and_resolve_references()
  config.mesh.shard_state = chosen
  return config


def compiled(prog: Program, run_once: bool = False) -> Program:
  """`prog` with its step compiled once (`Program.executable`, the step the trainer calls).

  Our kernels never stop a run: when the program holds the dropout-attention kernels or the hand-written
  CUDA gradients (`choice.OWN_MARKS`) and fails with an error that is theirs
  (`kernel_fallback.our_kernels_failed`: raised while the kernels were traced or lowered, or naming them
  from XLA's compile or from the run), it is built again without any of them (`Target.own_kernels` False:
  the explicit path, JAX's gradients, the same values), after one warning line naming the kernels, the
  stage and the reason. Any other failure is raised as it is, once. `run_once`: where the program's devices
  are this process's (one process), the compiled step is also run once on zeros (`kernel_fallback.run_once`)
  when it holds them, so that a kernel that cannot be launched here falls back the same way before the
  run's state exists (the trainer, the bench's timed steps); a kernel that hangs, or faults the device, is
  not caught (docs/reliability.md)."""
  if prog.executable is not None and not run_once:  # compiled already (`chunk_size=auto`'s tries)
    return prog
  lowered, stage = None, "compile"
  try:
    lowered = prog.lower()
    executable = lowered.compile(prog.compiler_options)
    if run_once and kernel_fallback.worth_running_once(prog, lowered):
      stage = "run"
      kernel_fallback.run_once(prog, executable)
    return dataclasses.replace(prog, executable=executable)
  except Exception as error:  # noqa: BLE001  (sorted below: only our kernels' failures fall back)
    if not kernel_fallback.our_kernels_failed(lowered, error):
      raise
    plain = prog.rebuild(dataclasses.replace(prog.target, own_kernels=False, interpret=False), prog.steps)
    reason = (str(error).strip().splitlines() or [""])[0][:300]
    logging.warning("the dropout-attention kernels (micse_jax/kernels/dropout_attention.py) or the CUDA gradients "
                    "(kernels/choice.own_gradients) failed %s for %s (%s: %s); training without them on the explicit "
                    "attention path, the same values (--config.model.attention=explicit skips the kernels' attempt)",
                    "when run" if stage == "run" else "to compile", prog.target.describe(), type(error).__name__, reason)
    return dataclasses.replace(plain, executable=plain.lower().compile(plain.compiler_options))


def of_runs(config: ml_collections.ConfigDict, runs: list, devices=None, steps: int | None = None) -> Program:
  """The program of `config`'s prepared runs (`run_inputs.prepare`: the run, or each member): the
  encoder's shapes and special tokens of the first, which all share; `steps` per call as `build`."""
  first = runs[0]
  return build(config, first.bert_config, abstract_of(first.encoder_params), devices, first.tokens, steps=steps)


def _jitted_step(config, nets, mesh: Mesh, sharding, layout: BatchLayout, members: int) -> Callable:
  """The one jit of the training call: a step for each row of a chunk of packed batches (unpacked
  inside; the chunk's length is the program's `steps`), the state in and out on `sharding` (donated);
  a population's step vmapped over its members, with their step inputs; a solo run's non-finite
  watch folded in at every step."""
  schedule = learning_rate_schedule(config)
  replicated = data_parallel.replicated(mesh)
  if members:
    member_step = make_train_step(config, nets, schedule, population_placement.inner_mesh(mesh))
    one = population.make_population_step(member_step, layout, mesh)
    per_member = population_placement.member_sharding(mesh)

    def pinned_step(state, packed, hyper):
      state, metrics = one(_pinned(state, sharding), packed, hyper)
      return _pinned(state, sharding), metrics

    def population_steps(state, packed, hyper):
      state, metrics = chunk_loop.repeated(lambda s, p: pinned_step(s, p, hyper), state, packed)
      return state, metrics, state.stopped_at
    fn = population_steps
    shardings = ((sharding, population_placement.batch_sharding(mesh, chunked=True), per_member),
                 (sharding, per_member, per_member))
  else:
    step = make_train_step(config, nets, schedule, mesh)

    def watched(carry, packed):
      state, watch = carry
      state, metrics = step(_pinned(state, sharding), layout.unpack(packed))
      state = _pinned(state, sharding)
      return (state, non_finite.fold(watch, metrics, state.step)), metrics

    def train_steps(state, packed, watch):
      (state, watch), metrics = chunk_loop.repeated(watched, (state, watch), packed)
      return state, metrics, watch
    fn, shardings = train_steps, ((sharding, data_parallel.chunk_sharded(mesh), replicated),
                                  (sharding, replicated, replicated))
  return jax.jit(fn, in_shardings=shardings[0], out_shardings=shardings[1], donate_argnums=0)


def _pinned(state, sharding):
  """The train state held on its sharding inside the loop. A loop's carry has no sharding of its own:
  without this, the partitioner lets the update's layout (Adam's moments split over the hidden axis)
  flow back into the params the next step's forward reads, which then splits the activations and
  all-reduces them inside every layer."""
  return jax.lax.with_sharding_constraint(state, sharding)
