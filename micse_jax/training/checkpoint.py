"""Saving and restoring train states in a workdir (layout and read-only access: `micse_jax/workdir.py`).

    workdir/checkpoints/<step>/   full TrainState, the last `keep` kept (atomic saves)
    workdir/best/<step>/          {'params': ...} of the best dev score so far (keep 1)
"""
from __future__ import annotations

import orbax.checkpoint as ocp

from micse_jax.workdir import best_manager, rolling_manager

__all__ = ["best_manager", "rolling_manager", "save_state", "restore_state", "save_best"]


def save_state(manager: ocp.CheckpointManager, state, metrics: dict | None = None) -> None:
  manager.save(int(state.step), args=ocp.args.StandardSave(state), metrics=metrics)


def restore_state(manager: ocp.CheckpointManager, abstract_state, step: int | None = None):
  step = manager.latest_step() if step is None else step
  return manager.restore(step, args=ocp.args.StandardRestore(abstract_state))


def save_best(manager: ocp.CheckpointManager, step: int, params, score: float) -> None:
  manager.save(step, args=ocp.args.StandardSave({"params": params}), metrics={"stsb_dev": score},
               force=True)
  manager.wait_until_finished()
