"""Running a sweep's training runs through submitit (local executor or one SLURM array job).

Each run is a subprocess `python -m micse_jax.main ...` in its own workdir, so a run is exactly
what a user would launch by hand; its output goes to `<workdir>/train.log`. A status file
`<workdir>/sweep_status.json` records `done` / `failed` (with the run's error line), so that
re-running a sweep skips finished runs and re-submits the others; an interrupted run resumes from
its own Orbax checkpoint (micse_jax.main resumes any workdir holding checkpoints).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from micse_jax.optional import require
from micse_jax.studies.spec import RunSpec, main_command

STATUS_FILE = "sweep_status.json"
LOG_FILE = "train.log"


class RunFailed(RuntimeError):
  """A training run exited non-zero; the message is its error line."""


def read_status(workdir: str) -> dict:
  """A run's status.json (`{}` when it has none yet); a population member's is its population's."""
  path = os.path.join(workdir, STATUS_FILE)
  if not os.path.isfile(path):
    from micse_jax.workdir import member_of  # Flax, Orbax: only for a population member's folder
    population = member_of(workdir)
    return read_status(population[0]) if population is not None else {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _write_status(workdir: str, status: dict) -> None:
  path = os.path.join(workdir, STATUS_FILE)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(status, f, indent=2)
  os.replace(path + ".tmp", path)


def checkpoint_steps(workdir: str) -> list[int]:
  """Steps of the rolling Orbax checkpoints in a workdir (numeric sub-directories)."""
  folder = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(folder):
    return []
  return sorted(int(d) for d in os.listdir(folder) if d.isdigit())


def plan(run: RunSpec) -> str:
  """'skip' (finished), 'resume from step N' (interrupted) or 'start'."""
  if read_status(run.workdir).get("status") == "done":
    return "skip"
  steps = checkpoint_steps(run.workdir)
  return f"resume from step {steps[-1]}" if steps else "start"


def _error_line(log_path: str) -> str:
  """The run's one-line error ('error: ...'), else its last non-empty output line."""
  with open(log_path, encoding="utf-8", errors="replace") as f:
    lines = [line.strip() for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
  errors = [line for line in lines if line.startswith("error:")]
  return (errors or lines or ["no output"])[-1]


def run_training(run: RunSpec) -> dict:
  """The submitit job: one `micse_jax.main` training; raises RunFailed with its error line."""
  os.makedirs(run.workdir, exist_ok=True)
  log_path = os.path.join(run.workdir, LOG_FILE)
  _write_status(run.workdir, {"status": "running", "host": os.uname().nodename, "started": time.time()})
  start = time.perf_counter()
  with open(log_path, "a", encoding="utf-8") as log:
    log.write(f"$ {' '.join(main_command(run))}\n")
    log.flush()
    returncode = subprocess.call(main_command(run), stdout=log, stderr=subprocess.STDOUT)
  elapsed = time.perf_counter() - start
  if returncode != 0:
    error = _error_line(log_path)
    _write_status(run.workdir, {"status": "failed", "returncode": returncode, "error": error,
                                "seconds": elapsed})
    raise RunFailed(f"{run.name}: {error}")
  _write_status(run.workdir, {"status": "done", "seconds": elapsed})
  return {"name": run.name, "seconds": elapsed}


def local_executor(folder: str, timeout_min: int):
  """A submitit executor running jobs as local processes (this Python, its installed micse_jax)."""
  submitit = require("submitit", "running a sweep (micse_jax.sweep)")
  executor = submitit.LocalExecutor(folder=folder)
  executor.update_parameters(timeout_min=timeout_min)
  return executor


def slurm_parameters(*, partition: str | None, gpus_per_run: int, cpus_per_run: int, timeout_min: int,
                     max_parallel: int, account: str | None = None, extra_setup: tuple = ()) -> dict:
  """submitit SlurmExecutor parameters of a sweep: one task per run, `max_parallel` array tasks at once."""
  params = dict(time=timeout_min, gpus_per_node=gpus_per_run, cpus_per_task=cpus_per_run, ntasks_per_node=1,
                nodes=1, array_parallelism=max_parallel, job_name="micse_sweep",
                setup=list(extra_setup))
  if partition:
    params["partition"] = partition
  if account:
    params["account"] = account
  return params


def slurm_executor(folder: str, params: dict):
  """A SlurmExecutor whose `map_array` submits one array job (`--array=0-(n-1)%array_parallelism`)."""
  submitit = require("submitit", "running a sweep (micse_jax.sweep)")
  executor = submitit.SlurmExecutor(folder=folder)
  executor.update_parameters(**params)
  return executor


def slurm_script(folder: str, params: dict, num_runs: int) -> str:
  """The sbatch script submitit would submit for `num_runs` runs (for --dry_run; no cluster needed)."""
  slurm = require("submitit.slurm.slurm", "writing a sweep's sbatch script (micse_jax.sweep --dry_run)")
  command = " ".join([sys.executable, "-u -m submitit.core._submit", str(folder)])
  return slurm._make_sbatch_string(command=command, folder=folder, map_count=num_runs, **params)


def _outcome(job, run: RunSpec) -> tuple[str, str]:
  """('done' | 'failed', message) of a finished submitit job."""
  try:
    job.result()
    return "done", ""
  except Exception as e:  # submitit wraps the job's exception
    status = read_status(run.workdir)
    return "failed", status.get("error") or str(e).strip().splitlines()[-1]


def run_local(runs: list[RunSpec], folder: str, parallel: int, timeout_min: int, log=print) -> dict:
  """Runs on this machine, `parallel` at a time; a failure is reported and the others go on."""
  executor = local_executor(folder, timeout_min)
  pending, active, outcomes = list(runs), [], {}
  while pending or active:
    while pending and len(active) < max(1, parallel):
      run = pending.pop(0)
      active.append((executor.submit(run_training, run), run))
      log(f"[sweep] started {run.name}")
    time.sleep(0.5)
    for job, run in [a for a in active if a[0].done()]:
      active.remove((job, run))
      outcomes[run.name] = _outcome(job, run)
      state, message = outcomes[run.name]
      log(f"[sweep] {state} {run.name}" + (f": {message}" if message else ""))
  return outcomes


def submit_slurm(runs: list[RunSpec], executor) -> list:
  """Submits all runs as one SLURM array job; returns the submitit jobs."""
  jobs = executor.map_array(run_training, runs)
  return jobs
