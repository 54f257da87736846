"""TensorBoard scalars of a training run (tensorboardX), shared by the trainer and the population trainer."""
from __future__ import annotations

import os

import jax
import numpy as np

from micse_jax import workdir as workdir_lib


def summary_writer(directory: str):
  """A `SummaryWriter` on `directory/tensorboard` (process 0 only; None elsewhere)."""
  if jax.process_index() != 0:
    return None
  from tensorboardX import SummaryWriter
  return SummaryWriter(os.path.join(directory, workdir_lib.TENSORBOARD_DIR))


def write_scalars(writer, step: int, scalars: dict) -> None:
  """Writes `scalars` at `step`: a name without "/" is a training value (`train/`); evaluators
  tag their own (`DevSelection.PREFIX`, `evaluation/evaluators/heldout.PREFIX`)."""
  if writer is None:
    return
  for k, v in scalars.items():
    writer.add_scalar(k if "/" in k else f"train/{k}", float(np.asarray(v)), step)
  writer.flush()
