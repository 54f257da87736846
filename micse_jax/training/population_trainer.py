"""The training loop of a population (`population.seeds`, `training/population.py`), called by
`trainer.train_and_evaluate`: one jitted step for all members, the stacked states in the
workdir's rolling `checkpoints/` (resumable on any topology), and per member, in
`members/<i>/` (`workdir.member_dir`), what a solo run writes: its solo `config.json`, dev
selection into its own `best/`, `results.json`, `timeline.json` and TensorBoard scalars.

Kept apart from `population.py` (the step and the state) because it builds the members' runs
(`setup.prepare`, which imports `config_checks`, which composes `population.check_config`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from micse_jax import timeline
from micse_jax import workdir as workdir_lib
from micse_jax.data.packing import BatchLayout
from micse_jax.data.prefetch import Prefetcher
from micse_jax.encoder import SentenceEncoder
from micse_jax.errors import ConfigError, NonFiniteLossError
from micse_jax.evaluators import is_due
from micse_jax.evaluators.dev_selection import DevSelection, final_evaluation
from micse_jax.evaluators.heldout import HeldoutMetrics
from micse_jax.models.bert import BertModel
from micse_jax.training import checkpoint, population, summaries
from micse_jax.training.optim import learning_rate_schedule, make_optimizer
from micse_jax.training.setup import Run, initial_state, prepare


@dataclasses.dataclass
class _Members:
  """The members' runs, folders, best managers and scores, TensorBoard writers; stop reports."""
  config: ml_collections.ConfigDict  # the population's
  runs: list[Run]
  dirs: list[str]
  selection: DevSelection
  best: list
  best_scores: list[float]
  writers: list
  heldout: HeldoutMetrics | None = None
  reported: set = dataclasses.field(default_factory=set)

  @classmethod
  def create(cls, config, runs: list[Run], workdir: str) -> "_Members":
    """Member folders with their solo config.json; the dev selection shared by all members."""
    dirs = [workdir_lib.member_dir(workdir, i) for i in range(len(runs))]
    first = jax.process_index() == 0
    for d, run in zip(dirs, runs):
      os.makedirs(d, exist_ok=True)
      if first:
        workdir_lib.write_run_config(d, _config_json(run))
    best = [workdir_lib.best_manager(d) for d in dirs]
    scores = [float(m.metrics(m.best_step())[workdir_lib.BEST_METRIC]) if m.best_step() is not None else -math.inf
              for m in best]
    run = runs[0]
    encoder = SentenceEncoder(BertModel(run.bert_config, dtype=run.nets.online.dtype), None, run.tokenizer,
                              model_dir=run.model_dir)
    writers = [summaries.summary_writer(d) for d in dirs]
    return cls(config, runs, dirs, DevSelection(encoder, run.config.eval, run.config.eval_every), best, scores,
               writers, HeldoutMetrics.create(encoder, run.config))

  @property
  def evaluates(self) -> bool:
    return self.selection.enabled or self.heldout is not None

  def alive(self, pstate) -> list[int]:
    return [i for i, s in enumerate(np.asarray(pstate.stopped_at)) if s == population.STOPPED]

  def report_stopped(self, pstate, bar) -> None:
    """One line per newly stopped member; NonFiniteLossError once no member trains any more."""
    alive = len(self.alive(pstate))
    for i, step in population.newly_stopped(pstate.stopped_at, self.reported):
      line = population.stopped_line(i, self.runs[i].config.seed, step, alive)
      logging.warning(line)
      bar.write(line)
    if alive == 0:
      raise NonFiniteLossError("every population member went non-finite; stopped, the last saved checkpoint is "
                               "intact (lower optim.learning_rate?)")

  def log(self, metrics, done: int, pstate) -> None:
    """Each training member's step metrics into its own TensorBoard folder."""
    host = jax.device_get(metrics)
    for i in self.alive(pstate):
      summaries.write_scalars(self.writers[i], done, population.member_metrics(host, i))

  def evaluate(self, pstate, bar) -> None:
    """Every training member's held-out metrics (`analysis.*`) and dev selection (a better score
    saves that member's `best/`)."""
    done = int(pstate.step)
    for i in self.alive(pstate):
      params = population.member(pstate.members.params, i)
      if self.heldout is not None:
        stats = self.heldout(params["encoder"])
        summaries.write_scalars(self.writers[i], done, stats)
        bar.write(f"step {done} member {i}: " + ", ".join(f"{k} {v:.4f}" for k, v in stats.items()))
      if not self.selection.enabled:
        continue
      scores = self.selection(params)
      if scores[workdir_lib.BEST_METRIC] > self.best_scores[i]:
        self.best_scores[i] = scores[workdir_lib.BEST_METRIC]
        with timeline.phase("save"):
          checkpoint.save_best(self.best[i], done, params, self.best_scores[i], wait=False)
      summaries.write_scalars(self.writers[i], done, self.selection.tagged(scores))
      bar.write(f"step {done} member {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in scores.items()))

  def close(self) -> None:
    for manager in self.best:
      manager.wait_until_finished()
    for writer in self.writers:
      if writer:
        writer.close()


def _config_json(run: Run) -> dict:
  return {**run.config.to_dict(), "model_dir": run.model_dir, "bert_config": run.bert_config.to_dict()}


@dataclasses.dataclass
class FreshPopulation:
  """A population at step 0, ready to step: its runs, the shared optimizer config and `tx`, the
  mesh, the state's sharding, the batch layout, the jitted step and the placed state."""
  runs: list[Run]
  shared: ml_collections.ConfigDict
  tx: object
  mesh: object
  sharding: object
  layout: BatchLayout
  step: object
  state: object


def fresh_population(config: ml_collections.ConfigDict, devices=None) -> FreshPopulation:
  """`config`'s population at step 0 on `devices` (default: all), without a workdir (the bench, tests)."""
  runs = [prepare(mc) for mc in population.member_configs(config)]
  shared = population.optimizer_config(config)
  tx = make_optimizer(shared)
  mesh = population.population_mesh(len(runs), devices)
  pstate = population.initial_state([jax.device_get(initial_state(r, tx)) for r in runs])
  sharding = population.state_sharding(jax.eval_shape(lambda: pstate), mesh)
  layout = BatchLayout.of(runs[0].batches.batch(0))
  step = population.jit_population_step(shared, runs[0].nets, tx, learning_rate_schedule(shared), layout, mesh,
                                        sharding)
  return FreshPopulation(runs, shared, tx, mesh, sharding, layout, step, jax.device_put(pstate, sharding))


def _start(config, runs: list[Run], tx, mesh, rolling, session):
  """(state sharding, step-0 or resumed PopulationState)."""
  abstract = population.abstract_state(jax.eval_shape(lambda: initial_state(runs[0], tx)), len(runs))
  sharding = population.state_sharding(abstract, mesh)
  with session.phase("load"):
    if rolling.latest_step() is not None:
      placed = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, sharding)
      pstate = checkpoint.resume(rolling, placed)  # any topology
      logging.info("resumed the population from step %d", int(pstate.step))
    else:
      pstate = jax.device_put(population.initial_state([jax.device_get(initial_state(r, tx)) for r in runs]),
                              sharding)
  return sharding, pstate


def train(config: ml_collections.ConfigDict, workdir: str, session: timeline.Timeline) -> dict:
  """Trains the population of `config` into `workdir` (resuming); returns {'members': [results]}."""
  if jax.process_count() > 1:
    raise ConfigError("population training runs on one host (several devices are fine)")
  runs = [prepare(mc) for mc in population.member_configs(config)]
  shared = population.optimizer_config(config)
  tx = make_optimizer(shared)
  mesh = population.population_mesh(len(runs))
  os.makedirs(workdir, exist_ok=True)
  rolling = workdir_lib.rolling_manager(workdir, config.keep_checkpoints)
  sharding, pstate = _start(config, runs, tx, mesh, rolling, session)
  session.info.update(steps={"from": int(pstate.step), "to": int(pstate.step)}, finished=False,
                      population={"size": len(runs), "seeds": list(config.population.seeds),
                                  "placement": mesh.axis_names[0]})
  if jax.process_index() == 0:
    workdir_lib.write_run_config(workdir, {**config.to_dict(), "model_dir": runs[0].model_dir,
                                          "bert_config": runs[0].bert_config.to_dict()})
  layout = BatchLayout.of(runs[0].batches.batch(int(pstate.step)))
  step_fn = population.jit_population_step(shared, runs[0].nets, tx, learning_rate_schedule(shared), layout,
                                           mesh, sharding)
  with session.phase("eval"):
    members = _Members.create(config, runs, workdir)
  try:
    with session.phase("train"):
      pstate = _loop(members, pstate, step_fn, (mesh, layout), rolling)
    session.info["steps"]["to"] = int(pstate.step)
  finally:
    with session.phase("save"):
      rolling.wait_until_finished()
      members.close()
  with session.phase("final_eval"):
    results = [_final_evaluation(members, i, pstate) for i in range(len(runs))]
  session.info["finished"] = True
  return {"members": results}


def _loop(members: _Members, pstate, step_fn, placement, rolling):
  """`trainer._loop` for a population: stopped members are reported at log/eval/save steps."""
  c, (mesh, layout) = members.runs[0].config, placement
  start = int(pstate.step)
  hyper = population.hyper(members.config)
  batches = [r.batches for r in members.runs]
  bar = tqdm(range(start, c.num_train_steps), initial=start, total=c.num_train_steps,
             disable=jax.process_index() != 0, desc=f"train x{len(members.runs)}")
  members.report_stopped(pstate, bar)
  place = lambda step: population.stacked_batch(batches, layout, step, mesh)
  with Prefetcher(place, range(start, c.num_train_steps), c.data.prefetch) as prefetched:
    for step, batch in zip(bar, prefetched):
      pstate, metrics = step_fn(pstate, batch, hyper)
      done = step + 1
      last = done == c.num_train_steps
      log, save = done % c.log_every == 0 or last, done % c.checkpoint_every == 0 or last
      evaluate = members.evaluates and is_due(done, c.eval_every, c.num_train_steps)
      if log or evaluate or save:
        members.report_stopped(pstate, bar)
      if log:
        members.log(metrics, done, pstate)
      if evaluate:
        with timeline.phase("eval"):
          members.evaluate(pstate, bar)
      if save:
        with timeline.phase("save"):
          checkpoint.save_state(rolling, pstate)
        timeline.checkpoint_saved(done)
  return pstate


def _final_evaluation(members: _Members, index: int, pstate) -> dict:
  """Member `index`'s `eval.final_tasks` on its best params (else its last ones) into its folder."""
  if not members.selection.has_final_tasks:
    return {}
  params = population.member(pstate.members.params, index)
  which = f"last step {int(population.member(pstate.members.step, index))}"
  if members.best[index].all_steps():
    best_step, params = workdir_lib.restore_params(members.dirs[index], "best")
    which = f"best STS-B dev (step {best_step}, {members.best_scores[index]:.2f})"
  return final_evaluation(members.selection, members.dirs[index], params, which)


def member_dirs(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """The member folders of a population run that exist (for the timeline); [] for a solo run."""
  dirs = [workdir_lib.member_dir(workdir, i) for i in range(population.size(config))]
  return [d for d in dirs if os.path.isdir(d)]
