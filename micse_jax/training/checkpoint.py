"""Orbax checkpoints in the workdir: rolling train states and the best (STS-B dev) params.

    workdir/checkpoints/<step>/   full TrainState, the last `keep` kept (atomic saves)
    workdir/best/<step>/          {'params': ...} of the best dev score so far (keep 1)
    workdir/config.json           the training config (+ the resolved model directory)
"""
from __future__ import annotations

import json
import os

import orbax.checkpoint as ocp

from micse_jax.models.bert import BertConfig

CONFIG_FILE = "config.json"


def rolling_manager(workdir: str, keep: int, read_only: bool = False) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=None if read_only else keep,
                                           create=not read_only, read_only=read_only))


def best_manager(workdir: str, read_only: bool = False) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), "best"),
      options=ocp.CheckpointManagerOptions(max_to_keep=None if read_only else 1,
                                           create=not read_only, read_only=read_only,
                                           best_mode="max", best_fn=lambda metrics: metrics["stsb_dev"]))


def save_state(manager: ocp.CheckpointManager, state, metrics: dict | None = None) -> None:
  manager.save(int(state.step), args=ocp.args.StandardSave(state), metrics=metrics)


def restore_state(manager: ocp.CheckpointManager, abstract_state, step: int | None = None):
  step = manager.latest_step() if step is None else step
  return manager.restore(step, args=ocp.args.StandardRestore(abstract_state))


def save_best(manager: ocp.CheckpointManager, step: int, params, score: float) -> None:
  manager.save(step, args=ocp.args.StandardSave({"params": params}), metrics={"stsb_dev": score},
               force=True)
  manager.wait_until_finished()


def write_run_config(workdir: str, config_dict: dict) -> None:
  """Writes config.json atomically."""
  path = os.path.join(workdir, CONFIG_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(config_dict, f, indent=2, sort_keys=True, default=str)
  os.replace(tmp, path)


def read_run_config(workdir: str) -> dict:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{workdir} is not a training workdir (no {CONFIG_FILE})")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def is_workdir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, CONFIG_FILE)) and os.path.isdir(os.path.join(path, "checkpoints"))


def restore_for_export(workdir: str, which: str | int = "latest") -> dict:
  """Trained weights of a workdir: which = 'latest', 'best' or a step number.

  Returns {'bert_config', 'encoder_params', 'head_params', 'tokenizer_dir', 'step'} (numpy).
  """
  run = read_run_config(workdir)
  if which == "best":
    manager, key = best_manager(workdir, read_only=True), "best"
  else:
    manager, key = rolling_manager(workdir, keep=0, read_only=True), "rolling"
  steps = manager.all_steps()
  if not steps:
    raise FileNotFoundError(f"no {key} checkpoint in {workdir}")
  step = max(steps) if which in ("latest", "best") else int(which)
  if step not in steps:
    raise FileNotFoundError(f"no checkpoint at step {step} in {workdir} (have {sorted(steps)})")
  restored = manager.restore(step, args=ocp.args.StandardRestore())  # raw tree of arrays
  params = restored["params"]
  return {"bert_config": BertConfig.from_dict(run["bert_config"]), "encoder_params": params["encoder"],
          "head_params": params["head"], "tokenizer_dir": run["model_dir"], "step": step}
