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
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import orbax.checkpoint as ocp

from micse_jax.errors import CheckpointError
from micse_jax.training import weight_copies
from micse_jax.workdir import BEST_METRIC, current_device_sharding, newest_readable, step_reader, unreadable_reason

if TYPE_CHECKING:
  from micse_jax.training.legacy_checkpoints import Legacy

UNREADABLE_DIR = "unreadable_checkpoints"


def save_state(manager: ocp.CheckpointManager, state, metrics: dict | None = None) -> int | None:
  """Asynchronous save of the full train state at its step (returns once the arrays are on the host;
  Orbax writes into a temporary folder renamed to `<step>` when complete, so a crash keeps the last one).
  Returns the newest step whose save has committed (its folder renamed into place): the previous
  save's, waited for first, as Orbax's next save would; None when the manager holds none."""
  manager.wait_until_finished()
  committed = manager.latest_step()
  manager.save(int(state.step), args=ocp.args.StandardSave(weight_copies.dropped(state)), metrics=metrics)
  return committed


def on_current_devices(abstract_state):
  """Gives every leaf without a sharding this process's first device (generic over the tree)."""
  def place(leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=current_device_sharding())
    return leaf
  return jax.tree.map(place, abstract_state)


Layouts = Sequence["Legacy"]  # the older layouts a restore tries, in order, when the current one fails


def _restore_step(manager: ocp.CheckpointManager, step: int, abstract_state, legacy: Layouts):
  """The state at `step` on `abstract_state`; a checkpoint in one of the `legacy` layouts is restored
  in it and converted (one warning line). Errors are those of the current layout's restore. The
  half-precision weight copies, never saved, are rebuilt (`weight_copies.rebuilt`)."""
  restore = lambda target: manager.restore(step, args=ocp.args.StandardRestore(on_current_devices(target)))
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
