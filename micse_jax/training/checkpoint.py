"""Saving, resuming and setting aside train states (layout, managers, read-only access: `micse_jax/workdir.py`).

    workdir/checkpoints/<step>/   full TrainState, the last `keep` kept (atomic saves)
    workdir/best/<step>/          {'params': ...} of the best dev score so far (keep 1)
    workdir/unreadable_checkpoints/<step>/   a truncated/corrupt step set aside on resume

Restores are portable: every array is restored onto the sharding of the target the caller
builds for the *current* devices (the trainer: replicated over its mesh), never onto the
sharding stored in the checkpoint, so a run resumes on any device or host count. A checkpoint of
an older release's layout is converted on restore when the caller passes that layout
(`training/legacy_checkpoints.py` lists them).
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable

import jax
import orbax.checkpoint as ocp

from micse_jax.errors import CheckpointError
from micse_jax.training import legacy_checkpoints, weight_copies
from micse_jax.workdir import BEST_METRIC, current_device_sharding, newest_readable, step_reader, unreadable_reason

if TYPE_CHECKING:
  from micse_jax.training.legacy_checkpoints import Legacy

UNREADABLE_DIR = "unreadable_checkpoints"


def save_state(manager: ocp.CheckpointManager, state, metrics: dict | None = None) -> None:
  """Save of the full train state (device arrays, or a host copy: `host_copy`) at its step; Orbax
  writes into a temporary folder renamed to `<step>` when complete, so a crash keeps the last one.
  Asynchronous: it returns once device arrays are on the host (`manager.wait_until_finished()` waits
  for the write)."""
  manager.save(int(state.step), args=ocp.args.PyTreeSave(weight_copies.dropped(state)), metrics=metrics)


def host_copy(tree):
  """`tree`'s arrays copied to the host (NumPy), all transfers in flight at once: what a background
  save writes while the device goes on (a process's whole arrays: one host)."""
  return jax.device_get(weight_copies.dropped(tree))


def on_current_devices(abstract_state):
  """Gives every leaf without a sharding this process's first device (generic over the tree)."""
  def place(leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=current_device_sharding())
    return leaf
  return jax.tree.map(place, abstract_state)


def _restore_args(target) -> ocp.args.PyTreeRestore:
  """Orbax's arguments to restore a saved tree onto `target` (ShapeDtypeStructs with shardings)."""
  return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


Layouts = Sequence["Legacy"]  # the older layouts a restore tries, in order, when the current one fails


def _restore_step(manager: ocp.CheckpointManager, step: int, abstract_state, legacy: Layouts):
  """The state at `step` on `abstract_state`; a checkpoint in one of the `legacy` layouts is restored
  in it and converted (one warning line). Errors are those of the current layout's restore. The
  half-precision weight copies, never saved, are rebuilt (`weight_copies.rebuilt`)."""
  restore = lambda target: manager.restore(step, args=_restore_args(on_current_devices(target)))
  with_copies = lambda state: weight_copies.rebuilt(state, on_current_devices(abstract_state))
  try:
    return with_copies(restore(weight_copies.dropped(abstract_state)))
  except Exception as current_error:
    for layout in legacy:
      try:
        old = restore(layout.abstract_state)
      except Exception:
        continue
      logging.warning("checkpoint step %d in %s has an older release's layout (%s); converted", step,
                      manager.directory, layout.name)
      return with_copies(layout.convert(old))
    raise current_error from None


def _newest_readable_state(manager: ocp.CheckpointManager, abstract_state, steps, legacy: Layouts = ()):
  restore = lambda s: _restore_step(manager, s, abstract_state, legacy)
  return newest_readable(steps, restore, str(manager.directory))


def restore_state(manager: ocp.CheckpointManager, abstract_state, step: int | None = None,
                  legacy: Layouts = ()):
  """The state at `step` (default: the newest readable step), on `abstract_state`'s shardings
  (a checkpoint in one of the `legacy` layouts converted).

  Without `step`, an unreadable (truncated, corrupt) newest checkpoint falls back to the previous
  good one with a warning line; CheckpointError (one line) when no checkpoint can be read.
  """
  if step is None:
    return _newest_readable_state(manager, abstract_state, manager.all_steps(), legacy)[1]
  try:
    return _restore_step(manager, step, abstract_state, legacy)
  except Exception as e:  # Orbax, TensorStore and file errors alike
    raise CheckpointError(f"cannot restore checkpoint step {step} in {manager.directory}: "
                          f"{unreadable_reason(e)}") from e


def state_layout(tree) -> set[str]:
  """The key paths of a state tree's array leaves ("queue/ids", "opt_state/0/mu/...") — the same
  strings for a live `TrainState` and for the nested dicts Orbax reports as a checkpoint's metadata."""
  def name(key):
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
      if hasattr(key, attr):
        return str(getattr(key, attr))
    return str(key)
  return {"/".join(name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_layout(manager: ocp.CheckpointManager, abstract_state, legacy: Layouts = ()) -> None:
  """Refuses, in one line, a workdir whose newest checkpoint holds neither this train-state layout
  nor one of the `legacy` ones that are converted on restore (e.g. a layout of a development version). Its
  params stay readable (`micse-convert`, `micse-evaluate` read only `params`). An unreadable
  newest step is left to `resume`'s fallback."""
  step = manager.latest_step()
  reader = step_reader(str(manager.directory))
  try:
    saved = state_layout(reader.item_metadata(step).tree)
  except Exception:  # truncated / corrupt: resume() sets it aside and falls back
    return
  finally:
    reader.close()
  wanted = state_layout(weight_copies.dropped(abstract_state))
  if saved != wanted and all(saved != state_layout(layout.abstract_state) for layout in legacy):
    raise CheckpointError(
        f"checkpoint step {step} in {manager.directory} has another train-state layout than this micse_jax "
        f"(saved, not expected: {_some(saved - wanted)}; expected, not saved: {_some(wanted - saved)}): it was "
        "written by another version and cannot be resumed; start a new workdir (its params remain readable "
        "by micse-convert and micse-evaluate)")


def _some(names: set[str], most: int = 4) -> str:
  shown = sorted(names)[:most]
  return ", ".join(shown) + (f" and {len(names) - most} more" if len(names) > most else "") if shown else "none"


def resume(manager: ocp.CheckpointManager, abstract_state, legacy: Layouts = ()):
  """`restore_state` for the trainer, after `check_layout` (a checkpoint of a `legacy` layout converted);
  unreadable newer steps are moved to `unreadable_checkpoints/` (kept for inspection, not
  deleted) so that the resumed run can save those steps again."""
  check_layout(manager, abstract_state, legacy)
  step, state = _newest_readable_state(manager, abstract_state, manager.all_steps(), legacy)
  unreadable = [s for s in manager.all_steps() if s > step]
  if unreadable:
    _set_aside(manager, unreadable)
  return state


def _set_aside(manager: ocp.CheckpointManager, steps) -> None:
  directory = str(manager.directory)
  target_root = os.path.join(os.path.dirname(directory), UNREADABLE_DIR)
  if jax.process_index() == 0:
    os.makedirs(target_root, exist_ok=True)
    for s in steps:
      target = os.path.join(target_root, str(s))
      while os.path.exists(target):
        target += "_"
      shutil.move(os.path.join(directory, str(s)), target)
      logging.warning("moved unreadable checkpoint step %d to %s", s, target)
  if jax.process_count() > 1:
    ocp.multihost.sync_global_processes("micse_set_aside_unreadable")
  manager.reload()


def save_best(manager: ocp.CheckpointManager, step: int, params, score: float, wait: bool = True) -> None:
  """Saves `params` as the new best checkpoint (`score` = its `workdir.BEST_METRIC`); `wait=False`
  returns once the arrays are copied to the host (Orbax's asynchronous save: the file writes go on
  in the background; a later save or `manager.wait_until_finished()` waits for them)."""
  manager.save(step, args=ocp.args.StandardSave({"params": params}), metrics={BEST_METRIC: score},
               force=True)
  if wait:
    manager.wait_until_finished()


class Saver:
  """The loop's checkpoint writes, off its path: a rolling save (`state`) or a best save (`best`)
  blocks the loop only for the device-to-host copy of what it writes; one background thread then
  writes them one after another, in order (a best save never competes with a rolling one, never
  waits for it in the loop, and the params of a step that is saved both ways are copied to the host
  once: `best(..., host=...)`). `on_saved(step)` runs on that thread once a rolling step has committed.
  A write that fails is raised in the loop at its next save, `wait` or `close`.

  Several processes (multi-host) save as Orbax does, collectively and asynchronously from the
  device arrays (each writes its shards), in the loop's thread; `on_saved` is then told, at each
  save, the newest step committed before it.
  """

  PENDING = 2  # host copies queued behind the one being written, at most: the loop waits past that

  def __init__(self, rolling: ocp.CheckpointManager, on_saved: Callable[[int], None] = lambda step: None,
               background: bool | None = None):
    self.rolling, self.on_saved = rolling, on_saved
    self.background = jax.process_count() == 1 if background is None else background
    self._jobs: queue.Queue = queue.Queue(maxsize=self.PENDING)
    self._error: BaseException | None = None
    self._thread = None
    if self.background:
      self._thread = threading.Thread(target=self._write, name="micse-saver", daemon=True)
      self._thread.start()

  def state(self, state) -> dict:
    """Saves the full train state at its step; returns its host copy (where `best` can take the
    params of the same step from), or None when the save runs from device arrays."""
    self._raise()
    if not self.background:  # Orbax waits for the previous save first: that one has committed then
      self.rolling.wait_until_finished()
      self.on_saved(self.rolling.latest_step())
      save_state(self.rolling, state)
      return None
    host = host_copy(state)
    self._jobs.put((save_state, self.rolling, (host,), int(host.step)))
    return host

  def best(self, manager: ocp.CheckpointManager, step: int, params, score: float) -> None:
    """Saves `params` (device arrays, or the host copy of a `state` save of the same step) as the
    best of `manager`'s run."""
    self._raise()
    if not self.background:
      save_best(manager, step, params, score, wait=False)
      return
    self._jobs.put((save_best, manager, (step, jax.device_get(params), score), None))

  def wait(self) -> None:
    """Returns once everything asked for is written (raising a write's error)."""
    if self.background:
      self._jobs.join()
    else:
      self.rolling.wait_until_finished()
    self._raise()

  def close(self) -> None:
    """`wait`, then the writer thread ends."""
    try:
      self.wait()
    finally:
      if self._thread is not None:
        self._jobs.put(None)
        self._thread.join()
        self._thread = None

  def _write(self) -> None:
    """The writer thread: each job saved and waited for, in order; the first error kept (the jobs
    after it are dropped: the loop raises it)."""
    while True:
      job = self._jobs.get()
      try:
        if job is None:
          return
        save, manager, args, rolling_step = job
        if self._error is None:
          save(manager, *args)
          manager.wait_until_finished()
          if rolling_step is not None:
            self.on_saved(rolling_step)
      except BaseException as error:  # noqa: BLE001  (re-raised in the loop)
        self._error = self._error or error
      finally:
        self._jobs.task_done()

  def _raise(self) -> None:
    if self._error is not None:
      error, self._error = self._error, None
      raise error


def starting_state(prog, runs: list, rolling: ocp.CheckpointManager):
  """The state a run trains from: the newest readable checkpoint of `rolling` (any topology; an older
  release's layout converted on the way in, `legacy_checkpoints.layouts`), else the program's step 0
  of the prepared runs (`Program.initial_state`)."""
  if rolling.latest_step() is None:
    return prog.initial_state(runs)
  state = resume(rolling, prog.abstract_state, legacy_checkpoints.layouts(prog))
  logging.info("resumed from step %d", int(state.step))
  return state
