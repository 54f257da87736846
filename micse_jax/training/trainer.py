"""The training loop, for a solo run and a population alike: data → the program's jitted step
(`training/program.py`) → logs, evaluators, checkpoints.

A population (`population.seeds`) is K runs stepped by one program; the loop sees a solo run as
one run and a population as K (`training/run_views.py`: each run's folder, params, scalars and
whether it still trains), with one set-up, one resume path (older releases' layouts converted,
`training/legacy_checkpoints.py`), one evaluation, one logging path, one checkpoint-save site and one
final evaluation. The trainer owns the rolling `checkpoints/` and each run's `best/`; the
evaluators (`micse_jax/evaluation/evaluators/`) only score params, on the steps `evaluation.evaluators.is_due` names.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import ml_collections
from tqdm import tqdm

from micse_jax import caches, config_checks, timeline
from micse_jax import workdir as workdir_lib
from micse_jax.configs import population as population_fields
from micse_jax.data.prefetch import Prefetcher
from micse_jax.encoder import SentenceEncoder
from micse_jax.errors import ConfigError, NonFiniteLossError  # noqa: F401  (re-exported: trainer.NonFiniteLossError)
from micse_jax.evaluation.evaluators import is_due
from micse_jax.evaluation.evaluators.dev_selection import DevSelection, final_evaluation
from micse_jax.evaluation.evaluators.heldout import HeldoutMetrics
from micse_jax.models.bert import BertModel
from micse_jax.training import checkpoint, finite, legacy_checkpoints, precision, program, run_views, summaries
from micse_jax.training.run_inputs import Run
from micse_jax.training.run_views import RunView


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (resuming from `workdir` when it holds checkpoints); returns the final results (a
  population's: {'members': [each member's]}).

  The session's seconds per phase are added to `workdir/timeline.json` (`micse_jax/timeline.py`)
  and to each member folder's, at each checkpoint and at the end, also when training fails; never
  when the input was refused (nothing is written then)."""
  session = timeline.Timeline(lambda: _timeline_files(config, workdir)).start()
  try:
    return _train_and_evaluate(config, workdir, session)
  finally:
    session.finish()
    session.record()  # also written at each checkpoint (timeline.checkpoint_saved)


@dataclasses.dataclass
class _Loop:
  """What the loop works with: the program, the runs' views and evaluators, the rolling manager."""
  program: program.Program
  views: list[RunView]
  evaluators: "_Evaluators"
  rolling: object


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, session: timeline.Timeline) -> dict:
  """`train_and_evaluate` with its phases marked on `session`."""
  requested_dtype = config.model.dtype
  config = precision.with_resolved_dtype(config, announce=False)  # "auto" → this accelerator's dtype
  resume_notes = config_checks.check_run(config, workdir)  # ranges, SentEval, workdir, resume compatibility
  if population_fields.enabled(config) and jax.process_count() > 1:
    raise ConfigError("population training runs on one host (several devices are fine)")
  session.info["compilation_cache"] = caches.enable_compilation_cache(config)  # before the first compile
  runs = program.prepared_runs(config)  # all input validation before the workdir is touched
  precision.announce_dtype(requested_dtype, config.model.dtype)  # after the checks: nothing before an error line
  caches.announce_unusable()  # a cache folder that cannot be written: one line, the run goes on without it
  prog, first = program.compiled(program.of_runs(config, runs), run_once=True), runs[0]
  os.makedirs(workdir, exist_ok=True)
  rolling = workdir_lib.rolling_manager(workdir, config.keep_checkpoints)
  with session.phase("load"):
    state = _start(prog, runs, rolling)
  for note in resume_notes:  # a resumable change that alters the steps left, said once it has resumed
    logging.warning("%s", note)
  session.info.update(steps={"from": int(state.step), "to": int(state.step)}, finished=False)
  if prog.members:
    session.info["population"] = {"size": prog.members, "seeds": list(config.population.seeds),
                                  "placement": prog.mesh.axis_names[0]}
  if jax.process_index() == 0:
    workdir_lib.write_run_config(workdir, run_views.config_json(first, config))
  with session.phase("eval"):  # the dev sets read and tokenised once
    loop = _Loop(prog, run_views.create(config, runs, workdir), _Evaluators.create(first, prog), rolling)
  try:
    with session.phase("train"):
      state = _train(loop, state)
  finally:
    with session.phase("save"):
      rolling.wait_until_finished()
      run_views.close(loop.views)
  session.info["steps"]["to"] = int(state.step)  # its save (the last step saves) committed: waited for above
  with session.phase("final_eval"):
    results = [_final_evaluation(loop, view, state) for view in loop.views]
  session.info["finished"] = True
  return {"members": results} if prog.members else results[0]


def _start(prog: program.Program, runs: list[Run], rolling):
  """The state to train from: the newest readable checkpoint (any topology; an older layout
  converted), else step 0."""
  if rolling.latest_step() is None:
    return prog.initial_state(runs)
  state = checkpoint.resume(rolling, prog.abstract_state, legacy_checkpoints.layouts(prog))
  logging.info("resumed from step %d", int(state.step))
  return state


def _timeline_files(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """`timeline.json` of the workdir and of each population member's folder (the same seconds:
  the members share them)."""
  return [os.path.join(d, workdir_lib.TIMELINE_FILE) for d in [workdir, *run_views.folders(config, workdir)]]


@dataclasses.dataclass
class _Evaluators:
  """The dev selection and held-out metrics, built once from one dev encoder (params given per call)."""
  selection: DevSelection
  heldout: HeldoutMetrics | None

  @classmethod
  def create(cls, run: Run, prog: program.Program) -> "_Evaluators":
    """Evaluators on the run's model and tokenizer at the program's compute dtype (every member shares them)."""
    encoder = SentenceEncoder(BertModel(run.bert_config, dtype=prog.nets.online.dtype), None,
                              run.tokenizer, model_dir=run.model_dir)
    return cls(DevSelection(encoder, run.config.eval, run.config.eval_every),
               HeldoutMetrics.create(encoder, run.config))

  @property
  def active(self) -> bool:
    return self.selection.enabled or self.heldout is not None

  def __call__(self, view: RunView, params, done: int, bar) -> None:
    """A run's held-out metrics, then its dev selection (a better score saves its `best/`); logged."""
    if self.heldout is not None:
      stats = self.heldout(params["encoder"])  # alignment, uniformity, attention MI
      summaries.write_scalars(view.writer, done, stats)
      bar.write(f"step {done}{view.label}: " + ", ".join(f"{k} {v:.4f}" for k, v in stats.items()))
    if not self.selection.enabled:
      return
    scores = self.selection(params)
    if scores[workdir_lib.BEST_METRIC] > view.best_score:
      view.best_score = scores[workdir_lib.BEST_METRIC]
      with timeline.phase("save"):
        checkpoint.save_best(view.best, done, params, view.best_score, wait=False)  # waited for at the end
    summaries.write_scalars(view.writer, done, self.selection.tagged(scores))
    bar.write(f"step {done}{view.label}: " + ", ".join(f"{k} {v:.2f}" for k, v in scores.items()))


def _final_evaluation(loop: _Loop, view: RunView, state) -> dict:
  """`eval.final_tasks` of a run's best params (restored on any topology), else of its last ones,
  into its folder."""
  if not loop.evaluators.selection.has_final_tasks:
    return {}
  params, which = view.params(state), f"last step {view.step(state)}"
  if view.best.all_steps():
    best_step, params = workdir_lib.restore_params(view.folder, "best")
    which = f"best STS-B dev (step {best_step}, {view.best_score:.2f})"
  return final_evaluation(loop.evaluators.selection, view.folder, params, which)


def _due(c: ml_collections.ConfigDict, evaluates: bool, done: int) -> tuple[bool, bool, bool]:
  """(log, evaluate, save) after `done` steps; the last step does all three that are enabled."""
  last = done == c.num_train_steps
  return (done % c.log_every == 0 or last, evaluates and is_due(done, c.eval_every, c.num_train_steps),
          done % c.checkpoint_every == 0 or last)


def _log(bar, views: list[RunView], metrics, done: int, every: int, tick: float) -> float:
  """Reads the step's metrics (a sync); writes each training run's scalars with the steps/s since
  `tick`, shows the first one's on the progress bar; returns the new time mark."""
  host = jax.device_get(metrics)
  now = time.perf_counter()
  for i, view in enumerate(views):
    scalars = dict(view.scalars(host), steps_per_sec=every / max(now - tick, 1e-9))
    if i == 0:
      bar.set_postfix({k: f"{scalars[k]:.4g}" for k in ("loss", "infonce", "positive_only", "ami_mi")
                       if k in scalars})
    summaries.write_scalars(view.writer, done, scalars)
  return now


def _train(loop: _Loop, state):
  """Steps without a per-step sync: which runs still train is read only before logging,
  evaluating or saving, so a non-finite state is never logged, selected or saved."""
  c, prog = loop.views[0].run.config, loop.program
  start = int(state.step)
  bar = tqdm(range(start, c.num_train_steps), initial=start, total=c.num_train_steps,
             disable=jax.process_index() != 0, desc="train" + (f" x{prog.members}" if prog.members else ""))
  health, tick, saved = finite.Health(loop.views, state), time.perf_counter(), loop.rolling.latest_step()
  alive = health.alive(state, saved, bar.write)
  place = lambda step: prog.place_batch([v.run.batches.batch(step) for v in loop.views])
  with Prefetcher(place, range(start, c.num_train_steps), c.data.prefetch) as batches:
    for step, batch in zip(bar, batches):
      state, metrics = prog.step(*prog.inputs(state, batch))
      health.update(state, metrics)
      done = step + 1
      log, evaluate, save = _due(c, loop.evaluators.active, done)
      if log or evaluate or save:  # never log, select or save a non-finite state
        alive = health.alive(state, saved, bar.write)
      if log:
        tick = _log(bar, alive, metrics, done, c.log_every, tick)
      if evaluate:
        with timeline.phase("eval"):
          for view in alive:
            loop.evaluators(view, view.params(state), done, bar)
      if save:
        with timeline.phase("save"):
          committed = checkpoint.save_state(loop.rolling, state)
          saved = done
        timeline.checkpoint_saved(committed)  # the newest step whose save has committed, not `done`
  return state

