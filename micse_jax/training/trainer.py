"""The training loop, for a solo run and a population alike: data → the program's jitted calls
(`training/program.py`, several steps each: `training/dispatch.py`) → logs, evaluators, checkpoints.

A population (`population.seeds`) is K runs stepped by one program; the loop sees a solo run as
one run and a population as K (`training/run_slices.py`: each run's folder, params, scalars and
whether it still trains), with one set-up, one resume path (older releases' layouts converted,
`training/legacy_checkpoints.py`), one evaluation, one logging path, one checkpoint-save site and one
final evaluation. The trainer owns the rolling `checkpoints/` and each run's `best/`; the
evaluators (`micse_jax/evaluation/evaluators/`) only score params, on the steps `evaluation.evaluators.is_due` names.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import jax
import ml_collections
from tqdm import tqdm

from micse_jax import caches, config_checks, timeline
from micse_jax import workdir as workdir_lib
from micse_jax.data.prefetch import Prefetcher
from micse_jax.encoder import SentenceEncoder
from micse_jax.errors import NonFiniteLossError  # noqa: F401  (re-exported: trainer.NonFiniteLossError)
from micse_jax.evaluation.evaluators.dev_selection import DevSelection, final_evaluation
from micse_jax.evaluation.evaluators.heldout import HeldoutMetrics
from micse_jax.models.bert import BertModel
from micse_jax.training import (
  checkpoint,
  dispatch,
  distributed,
  non_finite,
  precision,
  program,
  run_inputs,
  run_slices,
  summaries,
)
from micse_jax.training.run_inputs import Run
from micse_jax.training.run_slices import RunView


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (resuming from `workdir` when it holds checkpoints); returns the final results (a
  population's: {'members': [each member's]}).

  The session's seconds per phase are added to `workdir/timeline.json` (`micse_jax/timeline.py`)
  and to each member folder's, at each committed checkpoint and at the end, also when training
  fails; never when the input was refused (nothing is written then)."""
  session = timeline.Timeline(lambda: _timeline_files(config, workdir)).start()
  try:
    return _train_and_evaluate(config, workdir, session)
  finally:
    session.finish()
    session.record()  # also written at each committed checkpoint (timeline.checkpoint_saved)


@dataclasses.dataclass
class _Loop:
  """What the loop works with: the programs by steps per call, the chunk plan, the runs' views and
  evaluators, the checkpoint writer."""
  programs: dict[int, program.Program]
  chunks: list[tuple[int, int]]
  views: list[RunView]
  evaluators: "_Evaluators"
  saver: checkpoint.Saver


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, session: timeline.Timeline) -> dict:
  """The run, top to bottom, each step one call that does only that, said in the log as it goes
  (`_note`; nothing is said or written before the input is checked):

  1. the config: "auto" dtype resolved, then checked (ranges, SentEval, workdir, resume compatibility);
  2. the devices, and the caches opened before the first compile;
  3. the data: `chunk_size` against the padded batch, each run's checkpoint, tokenizer and batches;
  4. the program: networks, dtype, state layout, `chunk_size=auto` chosen for the devices' memory (the
     last input check: a batch no block of which fits), the jitted step, compiling in the background;
  5. the state: fresh, or the newest checkpoint (older layouts converted on the way in), and its saver;
  6. the runs' folders and evaluators (their programs compiled now, not at the first evaluation);
  7. the loop, then the final evaluation."""
  config, dtype_line = precision.resolve_dtype(config)
  resume_notes = config_checks.check_run(config, workdir)
  devices = distributed.devices_for(config)
  session.info["compilation_cache"], cache_notes = caches.open_for_run(config)
  runs = run_inputs.prepare_runs(config, devices)
  prog = program.of_runs(config, runs, devices)  # chunk_size=auto chosen here: the last input check
  _say_checked(dtype_line, cache_notes, config, runs)
  rolling = workdir_lib.rolling_manager(workdir, config.keep_checkpoints)
  compiling = _compile_ahead(config, prog, rolling.latest_step() or 0)
  with session.phase("load"):
    state = checkpoint.starting_state(prog, runs, rolling)
  saver, views = checkpoint.Saver(rolling, on_saved=timeline.checkpoint_saved), []
  try:
    _note(f"state: step {int(state.step)}" + (" (resumed)" if int(state.step) else " (fresh)"))
    for line in resume_notes:  # a resumable change that alters the steps left, said once it has resumed
      logging.warning("%s", line)
    _session_started(session, prog, int(state.step), config)
    with session.phase("eval"):  # the dev sets read and tokenised once; their programs compiled now
      views, evaluators = run_slices.create(config, runs, workdir), _Evaluators.create(runs[0], prog)
      evaluators.warm([view.params(state) for view in views])
    _note(f"evaluators: dev selection {'on' if evaluators.selection.enabled else 'off'}, held-out metrics "
          f"{'off' if evaluators.heldout is None else 'on'}")
    chunks = _plan(config, evaluators.active, int(state.step), prog.steps)
    loop = _Loop(_compiled(prog, compiling, chunks), chunks, views, evaluators, saver)
    session.info["steps_per_dispatch"] = sorted({n for _, n in chunks}, reverse=True)
    _note(f"training steps {int(state.step)} to {config.num_train_steps}")
    with session.phase("train"):
      state = _train(loop, state)
  finally:
    with session.phase("save"):
      saver.close()
      run_slices.close(views)
  session.info["steps"]["to"] = int(state.step)  # its save (the last step saves) committed: waited for above
  with session.phase("final_eval"):
    results = [_final_evaluation(loop, view, state) for view in loop.views]
  session.info["finished"] = True
  return {"members": results} if prog.members else results[0]


def _note(line: str) -> None:
  """One step of the set-up said in the log (first process)."""
  if jax.process_index() == 0:
    logging.info("set-up: %s", line)


def _say_checked(dtype_line: str, cache_notes: list[str], config: ml_collections.ConfigDict, runs: list[Run]) -> None:
  """What the run says once its input is checked: the compute dtype (printed), an unusable cache folder
  (one warning), the config and data it read."""
  if jax.process_index() == 0:
    print(dtype_line, flush=True)
  for line in cache_notes:
    logging.warning("%s", line)
  _note(f"config checked; {jax.device_count()} {jax.devices()[0].platform} device(s)")
  _note(f"data: {len(runs)} run(s) of {runs[0].model_dir}, {runs[0].batches.num_sentences} sentences")


def _compile_ahead(config: ml_collections.ConfigDict, prog: program.Program, start: int) -> dict:
  """The program compiled in the background for each number of steps per call that the chunk plan
  from `start` will likely call (the usual one and the shorter one, if any; the plan is made again
  once the evaluators are known, `_compiled`), while the state loads and the evaluators compile."""
  guess = _plan(config, config.eval_every > 0, start, prog.steps)
  _note(f"program for {prog.target.describe()}, {prog.steps} step(s) per call: compiling")
  return {n: _Background(program.compiled, prog.with_steps(n), True) for n in {n for _, n in guess} or {prog.steps}}


def _session_started(session: timeline.Timeline, prog: program.Program, start: int,
                     config: ml_collections.ConfigDict) -> None:
  """The session's first facts: where it starts, and a population's size, seeds and placement."""
  session.info.update(steps={"from": start, "to": start}, finished=False)
  if prog.members:
    session.info["population"] = {"size": prog.members, "seeds": list(config.population.seeds),
                                  "placement": prog.mesh.axis_names[0]}


class _Background:
  """`fn(*args)` on a daemon thread (a compile: the process may exit with an input error meanwhile);
  `result()` waits for it and returns or raises what it did."""

  def __init__(self, fn, *args):
    self._box: dict = {}
    self._thread = threading.Thread(target=self._run, args=(fn, args), name="micse-compile", daemon=True)
    self._thread.start()

  def _run(self, fn, args) -> None:
    try:
      self._box["value"] = fn(*args)
    except BaseException as error:  # noqa: BLE001  (re-raised by result())
      self._box["error"] = error

  def result(self):
    self._thread.join()
    if "error" in self._box:
      raise self._box["error"]
    return self._box["value"]


def _plan(config: ml_collections.ConfigDict, evaluates: bool, start: int, steps: int) -> list[tuple[int, int]]:
  """The loop's chunks (first step, steps) from `start`: each log, evaluation and save step ends one."""
  syncs = dispatch.sync_steps(start, config.num_train_steps, lambda done: any(dispatch.sync_due(config, evaluates,
                                                                                               done)))
  return dispatch.plan(start, syncs, steps)


def _compiled(prog: program.Program, compiling: dict, chunks: list[tuple[int, int]]) -> dict[int, program.Program]:
  """The compiled programs the chunks call, by steps per call: those `compiling` in the background
  (the lengths of the plan guessed before the restore: the usual one and the shorter one, if any),
  and any other the plan needs (`prog` with its steps), compiled now."""
  programs = {n: job.result() for n, job in compiling.items()}
  for n in {n for _, n in chunks} - set(programs):
    programs[n] = program.compiled(prog.with_steps(n), run_once=True)
  return programs


def _timeline_files(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """`timeline.json` of the workdir and of each population member's folder (the same seconds:
  the members share them)."""
  return [os.path.join(d, workdir_lib.TIMELINE_FILE) for d in [workdir, *run_slices.folders(config, workdir)]]


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

  def warm(self, params_of_runs: list) -> None:
    """The evaluators' programs compiled on the runs' starting params, beside the train step's,
    instead of stopping the run at its first evaluation: the held-out metrics called once (one
    batch), the dev selection's encoder run on one batch of each shape (one per placement of the
    params: members spread over devices each have their own)."""
    placements = {}
    for params in params_of_runs:
      placements.setdefault(jax.tree.leaves(params)[0].sharding, params)
    for params in placements.values():
      if self.heldout is not None:
        self.heldout(params["encoder"])
      if self.selection.enabled:
        self.selection.compile(params)

  def __call__(self, view: RunView, params, done: int, bar, saver: checkpoint.Saver, host_params=None) -> None:
    """A run's held-out metrics, then its dev selection (a better score saves its `best/`, from
    `host_params` where the step's state was copied to the host already); logged."""
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
        t = time.perf_counter()
        saver.best(view.best, done, params if host_params is None else host_params, view.best_score)
        timeline.save_blocked(done, time.perf_counter() - t, kind="best")
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


class _Logs:
  """The training scalars of log steps, written one log later: a log step's metrics and health are
  copied to the host while the device goes on, and read at the next log, evaluation, save or the
  end, when they are long done (the pipeline never drains for a log)."""

  def __init__(self, bar, views: list[RunView], health: non_finite.Health, start: int):
    self.bar, self.views, self.health = bar, views, health
    self.pending, self.tick, self.last = None, time.perf_counter(), start

  def defer(self, done: int, metrics, watch, saved: int | None) -> None:
    """Holds a log step's metrics (those of its call's last step) and health."""
    self.flush()
    for leaf in jax.tree.leaves((metrics, watch)):
      leaf.copy_to_host_async()
    self.pending = (done, metrics, watch, saved)

  def flush(self) -> None:
    """Writes the held log step's scalars (its runs still training: the non-finite policy)."""
    if self.pending is None:
      return
    done, metrics, watch, saved = self.pending
    self.pending = None
    alive = self.health.alive(watch, saved, self.bar.write)  # never log a non-finite state
    host = jax.device_get(metrics)
    now = time.perf_counter()
    rate = (done - self.last) / max(now - self.tick, 1e-9)  # between the two log steps' reads
    for i, view in enumerate(alive):
      scalars = dict(view.scalars(host), steps_per_sec=rate)
      if i == 0:
        self.bar.set_postfix({k: f"{scalars[k]:.4g}" for k in ("loss", "infonce", "positive_only", "ami_mi")
                              if k in scalars})
      summaries.write_scalars(view.writer, done, scalars)
    self.tick, self.last = now, done


def _train(loop: _Loop, state):
  """Calls the programs on the plan's chunks without waiting for the device: which runs still train
  is read where the state is read anyway (before evaluating or saving) and one log later for a log
  step, so a non-finite state is never logged, selected or saved."""
  c, first = loop.views[0].run.config, loop.programs[loop.chunks[0][1]] if loop.chunks else None
  start = int(state.step)
  members = bool(first and first.members)
  bar = tqdm(total=c.num_train_steps, initial=start, disable=jax.process_index() != 0,
             desc="train" + (f" x{first.members}" if members else ""))
  watch = state.stopped_at if members else (first.fresh_watch() if first else None)
  health, saved = non_finite.Health(loop.views, watch if members else None), loop.saver.rolling.latest_step()
  alive = health.alive(watch, saved, bar.write) if first else loop.views
  logs = _Logs(bar, loop.views, health, start)
  place = lambda chunk: loop.programs[chunk[1]].place_chunk(
      [[v.run.batches.batch(s) for v in loop.views] for s in range(chunk[0], chunk[0] + chunk[1])])
  with dispatch.quiet_collector(), Prefetcher(place, loop.chunks, c.data.prefetch) as batches:
    for (step, n), batch in zip(loop.chunks, batches):
      state, metrics, watch = loop.programs[n].run(state, batch, watch)
      done = step + n
      bar.update(n)
      log, evaluate, save = dispatch.sync_due(c, loop.evaluators.active, done)
      if not (log or evaluate or save):
        continue
      dispatch.collect()  # where the loop waits or the device has work queued
      if not (evaluate or save):
        logs.defer(done, metrics, watch, saved)
        continue
      logs.flush()
      alive = health.alive(watch, saved, bar.write)  # reads the state's health: waits for the device
      if log:
        logs.defer(done, metrics, watch, saved)
        logs.flush()
      saved = _evaluate_and_save(loop, state, alive, done, evaluate, save, bar) or saved
  logs.flush()
  bar.close()
  return state


def _evaluate_and_save(loop: _Loop, state, alive: list[RunView], done: int, evaluate: bool, save: bool,
                       bar) -> int | None:
  """The evaluations and the rolling save after `done` steps (the state's host copy taken first when
  both are due, so a new best's params are not copied twice); returns `done` when it saved."""
  host = None
  if save:
    with timeline.phase("save"):
      t = time.perf_counter()
      host = loop.saver.state(state)
      timeline.save_blocked(done, time.perf_counter() - t)
  if evaluate:
    with timeline.phase("eval"):
      for view in alive:
        loop.evaluators(view, view.params(state), done, bar, loop.saver,
                        None if host is None else view.params(host))
  return done if save else None
