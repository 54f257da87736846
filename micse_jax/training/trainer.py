"""The training loop: data → jitted step over the device mesh → logs, evaluators, checkpoints.

The trainer owns both Orbax managers (rolling `checkpoints/`, `best/`); the evaluators
(`micse_jax/evaluators/`) only score params, on the steps `evaluators.is_due` names.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import jax
import ml_collections
import orbax.checkpoint as ocp
from tqdm import tqdm

from micse_jax import caches, config_checks, timeline
from micse_jax import workdir as workdir_lib
from micse_jax.data.packing import BatchLayout
from micse_jax.data.prefetch import Prefetcher
from micse_jax.encoder import SentenceEncoder
from micse_jax.errors import NonFiniteLossError  # noqa: F401  (re-exported: trainer.NonFiniteLossError)
from micse_jax.evaluators import is_due
from micse_jax.evaluators.dev_selection import DevSelection, final_evaluation
from micse_jax.evaluators.heldout import HeldoutMetrics
from micse_jax.models.bert import BertModel
from micse_jax.training import checkpoint, optim, population, population_trainer, precision, summaries
from micse_jax.training import mesh as mesh_lib
from micse_jax.training import state as state_lib
from micse_jax.training.finite import FiniteWatch
from micse_jax.training.optim import learning_rate_schedule, make_optimizer
from micse_jax.training.setup import Run, initial_state, prepare
from micse_jax.training.step import make_train_step


def jit_train_step(run: Run, tx, mesh, state_sharding, layout: BatchLayout):
  """The pure step jitted over `mesh`: state in/out on `state_sharding` (donated); the batch comes
  packed in one row-sharded array (`layout`, `data/packing.py`) and is unpacked inside the step."""
  step_fn = make_train_step(run.config, run.nets, tx, learning_rate_schedule(run.config), mesh)
  packed_step = lambda state, packed: step_fn(state, layout.unpack(packed))
  return jax.jit(packed_step, in_shardings=(state_sharding, mesh_lib.batch_sharded(mesh)),
                 out_shardings=(state_sharding, mesh_lib.replicated(mesh)), donate_argnums=0)


def legacy_layout(run: Run, mesh, state_sharding) -> checkpoint.Legacy:
  """The train state as releases before this one saved it (per-leaf AdamW moments,
  `optim.per_leaf_optimizer`; the queue as four loose fields, `state.as_legacy_fields`) on this
  mesh, and its conversion onto `state_sharding` (`optim.legacy_to_flat`, `state.from_legacy_fields`)."""
  config = run.config
  old = jax.eval_shape(lambda: state_lib.as_legacy_fields(initial_state(run, optim.per_leaf_optimizer(config))))
  old_sharding = mesh_lib.state_sharding(old, mesh, config.mesh.shard_state, config.mesh.shard_min_elements)
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), old, old_sharding)
  convert = jax.jit(lambda fields: state_lib.from_legacy_fields(fields, optim.legacy_to_flat),
                    out_shardings=state_sharding)
  return checkpoint.Legacy(abstract, convert)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (resuming from `workdir` when it holds checkpoints); returns the final results.

  The session's seconds per phase are added to `workdir/timeline.json` (`micse_jax/timeline.py`),
  also when training fails; never when the input was refused (nothing is written then)."""
  session = timeline.Timeline(lambda: _timeline_files(config, workdir)).start()
  try:
    return _train_and_evaluate(config, workdir, session)
  finally:
    session.finish()
    session.record()  # also written at each checkpoint (timeline.checkpoint_saved)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, session: timeline.Timeline) -> dict:
  """`train_and_evaluate` with its phases marked on `session`."""
  config = precision.with_resolved_dtype(config)  # "auto" → this accelerator's dtype, printed once
  config_checks.check_run(config, workdir)  # ranges, SentEval, workdir, resume compatibility
  session.info["compilation_cache"] = caches.enable_compilation_cache(config)  # before the first compile
  if population.enabled(config):  # K seeds in one jitted step (training/population.py)
    return population_trainer.train(config, workdir, session)
  run = prepare(config)  # all input validation happens before the workdir is touched
  mesh = mesh_lib.data_mesh()
  tx = make_optimizer(config)
  abstract_state = jax.eval_shape(lambda: initial_state(run, tx))
  state_sharding = mesh_lib.state_sharding(abstract_state, mesh, config.mesh.shard_state,
                                           config.mesh.shard_min_elements)
  os.makedirs(workdir, exist_ok=True)
  rolling = workdir_lib.rolling_manager(workdir, config.keep_checkpoints)
  with session.phase("load"):
    if rolling.latest_step() is not None:
      abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              abstract_state, state_sharding)
      legacy = legacy_layout(run, mesh, state_sharding)  # older workdirs: converted on restore
      state = checkpoint.resume(rolling, abstract, legacy)  # any topology; skips an unreadable latest step
      logging.info("resumed from step %d", int(state.step))
    else:
      state = jax.device_put(initial_state(run, tx), state_sharding)
  session.info.update(steps={"from": int(state.step), "to": int(state.step)}, finished=False)
  if jax.process_index() == 0:
    workdir_lib.write_run_config(workdir, {**config.to_dict(), "model_dir": run.model_dir,
                                          "bert_config": run.bert_config.to_dict()})
  layout = BatchLayout.of(run.batches.batch(int(state.step)))
  train_step = jit_train_step(run, tx, mesh, state_sharding, layout)
  with session.phase("eval"):  # the dev sets read and tokenised once
    evaluators = _Evaluators.create(run, workdir)
  writer = summaries.summary_writer(workdir)
  try:
    with session.phase("train"):
      state = _loop(run, state, train_step, (mesh, layout), rolling, evaluators, writer)
    session.info["steps"]["to"] = int(state.step)
  finally:
    with session.phase("save"):
      rolling.wait_until_finished()
      evaluators.best.wait_until_finished()
    if writer:
      writer.close()
  with session.phase("final_eval"):
    results = _final_evaluation(workdir, state, evaluators)
  session.info["finished"] = True
  return results


def _timeline_files(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """`timeline.json` of the workdir and of each population member's folder (the same seconds:
  the members share them)."""
  dirs = [workdir, *population_trainer.member_dirs(config, workdir)]
  return [os.path.join(d, workdir_lib.TIMELINE_FILE) for d in dirs]


@dataclasses.dataclass
class _Evaluators:
  """The run's evaluators, built from one dev encoder, and the `best/` manager they feed."""
  selection: DevSelection
  heldout: HeldoutMetrics | None
  best: ocp.CheckpointManager
  best_score: float

  @classmethod
  def create(cls, run: Run, workdir: str) -> "_Evaluators":
    """Evaluators on the run's model and tokenizer (params given per call); best score so far."""
    encoder = SentenceEncoder(BertModel(run.bert_config, dtype=run.nets.online.dtype), None,
                              run.tokenizer, model_dir=run.model_dir)
    best = workdir_lib.best_manager(workdir)
    step = best.best_step()
    score = float(best.metrics(step)[workdir_lib.BEST_METRIC]) if step is not None else -math.inf
    return cls(DevSelection(encoder, run.config.eval, run.config.eval_every),
               HeldoutMetrics.create(encoder, run.config), best, score)

  @property
  def active(self) -> bool:
    return self.selection.enabled or self.heldout is not None

  def __call__(self, state, writer, bar) -> None:
    """Dev selection (a better score saves `best/`), then the held-out metrics; logged."""
    done = int(state.step)
    if self.selection.enabled:
      scores = self.selection(state.params)
      if scores[workdir_lib.BEST_METRIC] > self.best_score:
        self.best_score = scores[workdir_lib.BEST_METRIC]
        with timeline.phase("save"):
          checkpoint.save_best(self.best, done, state.params, self.best_score, wait=False)  # waited for at the end
      summaries.write_scalars(writer, done, self.selection.tagged(scores))
      bar.write(f"step {done}: " + ", ".join(f"{k} {v:.2f}" for k, v in scores.items()))
    if self.heldout is not None:
      stats = self.heldout(state.params["encoder"])  # alignment, uniformity, attention MI
      summaries.write_scalars(writer, done, stats)
      bar.write(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in stats.items()))


def _final_evaluation(workdir: str, state, evaluators: _Evaluators) -> dict:
  """`eval.final_tasks` of the best params (restored on any topology), else of the last ones."""
  if not evaluators.selection.has_final_tasks:
    return {}
  params, which = state.params, f"last step {int(state.step)}"
  if evaluators.best.all_steps():
    best_step, params = workdir_lib.restore_params(workdir, "best")
    which = f"best STS-B dev (step {best_step}, {evaluators.best_score:.2f})"
  return final_evaluation(evaluators.selection, workdir, params, which)


def _prefetched_batches(run: Run, placement, start: int) -> Prefetcher:
  """Device-placed, packed global batches of steps `start`.. made `data.prefetch` ahead on a
  background thread; `placement` is (mesh, `BatchLayout`)."""
  mesh, layout = placement
  place = lambda step: mesh_lib.global_batch(layout.pack(run.batches.batch(step)), mesh)
  return Prefetcher(place, range(start, run.config.num_train_steps), run.config.data.prefetch)


def _due(c: ml_collections.ConfigDict, evaluators: _Evaluators, done: int) -> tuple[bool, bool, bool]:
  """(log, evaluate, save) after `done` steps; the last step does all three that are enabled."""
  last = done == c.num_train_steps
  return (done % c.log_every == 0 or last, evaluators.active and is_due(done, c.eval_every, c.num_train_steps),
          done % c.checkpoint_every == 0 or last)


def _log(bar, writer, metrics, done: int, every: int, tick: float) -> float:
  """Reads the step's metrics (a sync), shows and writes them; returns the new time mark."""
  host = {k: float(v) for k, v in jax.device_get(metrics).items()}
  now = time.perf_counter()
  host["steps_per_sec"] = every / max(now - tick, 1e-9)
  bar.set_postfix({k: f"{host[k]:.4g}" for k in ("loss", "infonce", "positive_only", "ami_mi") if k in host})
  summaries.write_scalars(writer, done, host)
  return now


def _loop(run: Run, state, train_step, placement, rolling, evaluators: _Evaluators, writer):
  """Steps without a per-step sync: finiteness is read only before logging, evaluating or saving."""
  c = run.config
  start = int(state.step)
  bar = tqdm(range(start, c.num_train_steps), initial=start, total=c.num_train_steps,
             disable=jax.process_index() != 0, desc="train")
  watch, tick = FiniteWatch(), time.perf_counter()
  with _prefetched_batches(run, placement, start) as batches:
    for step, batch in zip(bar, batches):
      state, metrics = train_step(state, batch)
      watch.update(metrics, state.step)
      done = step + 1
      log, evaluate, save = _due(c, evaluators, done)
      if log or evaluate or save:  # never log, select or save a non-finite state
        watch.check()
      if log:
        tick = _log(bar, writer, metrics, done, c.log_every, tick)
      if evaluate:
        with timeline.phase("eval"):
          evaluators(state, writer, bar)
      if save:
        with timeline.phase("save"):
          checkpoint.save_state(rolling, state)
        timeline.checkpoint_saved(done)
  return state


