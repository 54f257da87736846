"""A training workdir, read by inference, evaluation and export without importing the trainer.

    workdir/config.json           the training config (+ resolved model dir and BERT config)
    workdir/checkpoints/<step>/   rolling Orbax TrainStates (written by `training/checkpoint.py`)
    workdir/best/<step>/          {'params': ...} of the best STS-B dev score
    workdir/results.json          final evaluation of the best checkpoint
"""
from __future__ import annotations

import os

import orbax.checkpoint as ocp

from micse_jax import jsonio
from micse_jax.errors import CheckpointError
from micse_jax.models.bert import BertConfig

CONFIG_FILE = "config.json"
ROLLING_DIR = "checkpoints"
BEST_DIR = "best"


def is_workdir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, CONFIG_FILE)) and os.path.isdir(os.path.join(path, ROLLING_DIR))


def write_run_config(workdir: str, config_dict: dict) -> None:
  """Writes config.json atomically."""
  jsonio.write_json(os.path.join(workdir, CONFIG_FILE), config_dict, sort_keys=True)


def read_run_config(workdir: str) -> dict:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise CheckpointError(f"{workdir} is not a training workdir (no {CONFIG_FILE})")
  return jsonio.read_json(path)


def rolling_manager(workdir: str, keep: int, read_only: bool = False) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), ROLLING_DIR),
      options=ocp.CheckpointManagerOptions(max_to_keep=None if read_only else keep,
                                           create=not read_only, read_only=read_only))


def best_manager(workdir: str, read_only: bool = False) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), BEST_DIR),
      options=ocp.CheckpointManagerOptions(max_to_keep=None if read_only else 1,
                                           create=not read_only, read_only=read_only,
                                           best_mode="max", best_fn=lambda metrics: metrics["stsb_dev"]))


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
    raise CheckpointError(f"no {key} checkpoint in {workdir}")
  step = max(steps) if which in ("latest", "best") else int(which)
  if step not in steps:
    raise CheckpointError(f"no checkpoint at step {step} in {workdir} (have {sorted(steps)})")
  restored = manager.restore(step, args=ocp.args.StandardRestore())  # raw tree of arrays
  params = restored["params"]
  return {"bert_config": BertConfig.from_dict(run["bert_config"]), "encoder_params": params["encoder"],
          "head_params": params["head"], "tokenizer_dir": run["model_dir"], "step": step}
