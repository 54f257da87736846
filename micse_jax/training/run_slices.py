"""The runs a training loop steps, each its slice of the loop's one state: a solo run is one, a
population (`population.seeds`) one per member. The loop (`training/trainer.py`) is the same for both;
what differs is here:

- where a run's files go (`RunView.folder`): a solo run's workdir; member i's `members/<i>/`
  (`workdir.member_dir`), which reads like a solo workdir (its solo `config.json`, `best/`,
  `results.json`, `timeline.json`, TensorBoard scalars);
- how its params and scalars are read from the state and the step's metrics (member i's slice);
- which runs still train is the non-finite policy's (`training/non_finite.Health`).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from micse_jax import workdir as workdir_lib
from micse_jax.configs import population_fields
from micse_jax.training import population, summaries
from micse_jax.training.run_inputs import Run


@dataclasses.dataclass
class RunView:
  """One run of the loop, its view of the state: its member index (None: a solo run), set-up, folder, `best/` manager,
  best dev score so far and TensorBoard writer."""
  index: int | None
  run: Run
  folder: str
  best: ocp.CheckpointManager
  best_score: float
  writer: Any

  @property
  def label(self) -> str:
    """How the run's lines name it ('' for a solo run)."""
    return "" if self.index is None else f" member {self.index}"

  def params(self, state) -> dict:
    """The run's params in the loop's state."""
    return state.params if self.index is None else population.member(state.members.params, self.index)

  def step(self, state) -> int:
    """The run's own step (a stopped member's is the step it stopped at)."""
    return int(state.step if self.index is None else population.member(state.members.step, self.index))

  def scalars(self, metrics: dict) -> dict[str, float]:
    """The run's scalars from the step's host metrics."""
    if self.index is None:
      return {k: float(v) for k, v in metrics.items()}
    return population.member_metrics(metrics, self.index)


def folders(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """The runs' folders that exist besides `workdir` (a population's member folders; [] for a solo run)."""
  dirs = [workdir_lib.member_dir(workdir, i) for i in range(population_fields.size(config))]
  return [d for d in dirs if os.path.isdir(d)]


def create(config: ml_collections.ConfigDict, runs: list[Run], workdir: str) -> list[RunView]:
  """The runs' views; the workdir's `config.json` written (a population's config), and a member's folder
  created with its solo one."""
  solo = not population_fields.enabled(config)
  if jax.process_index() == 0:
    workdir_lib.write_run_config(workdir, config_json(runs[0], config))
  views = []
  for i, run in enumerate(runs):
    folder = os.path.abspath(workdir) if solo else workdir_lib.member_dir(workdir, i)
    if not solo:
      os.makedirs(folder, exist_ok=True)
      if jax.process_index() == 0:
        workdir_lib.write_run_config(folder, config_json(run))
    best = workdir_lib.best_manager(folder)
    step = best.best_step()
    score = float(best.metrics(step)[workdir_lib.BEST_METRIC]) if step is not None else -math.inf
    views.append(RunView(None if solo else i, run, folder, best, score, summaries.summary_writer(folder)))
  return views


def config_json(run: Run, config: ml_collections.ConfigDict | None = None) -> dict:
  """What a `config.json` holds: the run's config (or `config`, a population's), the resolved model
  folder and BERT config."""
  return {**(config or run.config).to_dict(), "model_dir": run.model_dir, "bert_config": run.bert_config.to_dict()}


def close(views: list[RunView]) -> None:
  """Waits for the `best/` saves; closes the writers."""
  for view in views:
    view.best.wait_until_finished()
    if view.writer:
      view.writer.close()
