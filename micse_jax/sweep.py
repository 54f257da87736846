"""Run a study: `python -m micse_jax.sweep --config configs/sweeps/fewshot_tiny.py [--executor local|slurm]`.

Expands the sweep (see micse_jax/studies/spec.py), checks every run's overrides and data before
starting anything, then runs the unfinished runs through submitit: `--executor local` on this
machine (`--parallel` at a time) or `--executor slurm` as one array job. Re-running skips finished
runs and resumes interrupted ones. `--report` writes results.{json,md,csv} and the figures in the
sweep directory. `--dry_run` prints the plan (and, for SLURM, writes the sbatch script) only.
`--population_size auto` (default) trains the runs that differ only in their seeds as populations
as large as the device memory allows (studies/population_size.py, docs/population.md).
"""
import logging
import os
import shlex
import sys

from absl import flags
from ml_collections import config_flags

from micse_jax import cli
from micse_jax.optional import require
from micse_jax.studies import population_size as sizing
from micse_jax.studies import runner, spec

config_flags.DEFINE_config_file("config", None, "Sweep config: a file `configs/sweeps/x.py[:arg]` or a "
                                "packaged name (`sweeps/micse_paper:fewshot`; --list_configs lists them).")
flags.DEFINE_bool("list_configs", False, "Print the packaged configs' names and exit.")
flags.DEFINE_string("sweep_dir", None, "Directory of the sweep's runs and tables (default runs/sweeps/<name>).")
flags.DEFINE_enum("executor", "local", ["local", "slurm"], "submitit executor.")
flags.DEFINE_integer("parallel", 1, "Local executor: runs at a time.")
flags.DEFINE_string("partition", None, "SLURM partition.")
flags.DEFINE_string("account", None, "SLURM account.")
flags.DEFINE_integer("gpus_per_run", 1, "SLURM: GPUs per run (one node).")
flags.DEFINE_integer("cpus_per_run", 8, "SLURM: CPUs per run.")
flags.DEFINE_integer("max_parallel", 64, "SLURM: array tasks running at once (--array=...%N).")
flags.DEFINE_integer("timeout_min", 24 * 60, "Per-run time limit in minutes.")
flags.DEFINE_multi_string("setup", [], "SLURM: extra shell lines before the run (module load, venv).")
flags.DEFINE_bool("report", False, "Only aggregate finished runs into tables and figures.")
flags.DEFINE_bool("dry_run", False, "Print the plan (write the sbatch script for SLURM); run nothing.")
flags.DEFINE_float("step_ms", None, "Dry run: milliseconds per training step for the GPU-hours estimate "
                   "(default: the sweep config's step_ms, an assumption stated there); at the sweep's step_ms_batch "
                   "when it sets one, scaled by each run's batch.")
flags.DEFINE_string("population_size", "auto", "Train runs that differ only in their seeds as populations of up "
                    "to K members, one program each (docs/population.md); 1: one program per run; auto: per group "
                    "the largest K whose compiled step fits --population_memory_use of the device memory (this "
                    "machine's accelerator or --population_target; 1 on a CPU without one).")
flags.DEFINE_string("population_target", None, "auto: size populations for this device, compiled deviceless here "
                    "(h100, a100, tpu-v5e, ...: bench --aot's targets; needs the extra 'aot' or 'tpu'), e.g. from "
                    "a SLURM login node; with --executor slurm on --gpus_per_run devices.")
flags.DEFINE_float("population_device_gib", None, "auto: GiB of device memory a run may use per device (default: "
                   "the accelerator's bytes_limit, or the GPU target's memory x JAX's 0.75 memory fraction; "
                   "required for a TPU target; on a CPU it sizes populations for the CPU).")
flags.DEFINE_float("population_memory_use", 0.9, "auto: fraction of that memory a population's compiled step may "
                   "need at its peak (the rest is headroom for evaluation and the allocator).")
flags.DEFINE_float("population_step_ms", None, "Dry run: measured milliseconds per step of the largest population "
                   "launched (default: that many times the step time: no speed-up assumed).")
flags.mark_flags_as_required(["config"])
FLAGS = flags.FLAGS


def _report(runs, sweep_dir, name) -> None:
  from micse_jax.studies import aggregate, plots  # NumPy and the report's modules: only for --report
  document = aggregate.write_reports(runs, sweep_dir, name)
  figures = plots.write_plots(document["rows"], sweep_dir)
  with open(os.path.join(sweep_dir, "results.md"), encoding="utf-8") as f:
    print(f.read())
  print(f"wrote results.json, results.md, results.csv{''.join(', ' + os.path.basename(p) for p in figures)} "
        f"in {sweep_dir}")


def _print_cost(sweep, todo) -> None:
  """Dry run: training steps left and GPU-hours of the runs still to do, with the step time's source."""
  step_ms = FLAGS.step_ms if FLAGS.step_ms is not None else sweep.get("step_ms")
  if step_ms is None:
    print("[sweep] GPU-hours: unknown (no step time: pass --step_ms or set step_ms in the sweep config)")
    return
  gpus = FLAGS.gpus_per_run if FLAGS.executor == "slurm" else 1
  done = {run.name: (runner.checkpoint_steps(run.workdir) or [0])[-1] for run in todo}
  sizes = sorted({spec.population_size_of(run) for run in todo} - {1})
  k = sizes[-1] if sizes else 1
  measured = {k: FLAGS.population_step_ms} if FLAGS.population_step_ms is not None and sizes else {}
  per_batch = sweep.get("step_ms_batch")
  try:
    steps, hours = spec.estimated_gpu_hours(todo, step_ms, gpus, done, measured, per_batch)
  except spec.SweepError as e:  # a step_ms (or step_ms_batch) <= 0 in the sweep config
    cli.fail(str(e), cli.USAGE_EXIT)
  source = "--step_ms" if FLAGS.step_ms is not None else sweep.get("step_ms_note") or "the sweep config"
  at_batch = f" at batch {per_batch} (× each run's batch / {per_batch})" if per_batch is not None else ""
  members = sum(spec.population_size_of(run) for run in todo)
  others = ", ".join(f"{j} × {step_ms:g} ms" for j in sizes[:-1])
  population = "" if not sizes else (
      f"; {members} member runs in {len(todo)} programs, a {k}-member step at "
      + (f"{FLAGS.population_step_ms:g} ms (--population_step_ms)" if measured else f"{k} × {step_ms:g} ms (no "
         "speed-up assumed; pass --population_step_ms with a measured figure)")
      + (f", smaller populations at {others}" if others else ""))
  print(f"[sweep] expected cost: {len(todo)} runs, {steps:,} training steps × {step_ms:g} ms/step{at_batch} × {gpus} GPU/run "
        f"= {hours:,.1f} GPU-hours (training steps only; evaluations not counted). Step time: {source}{population}")


def _dry_run(sweep, todo, sweep_dir: str, folder: str, slurm_params: dict | None) -> None:
  """Prints each run's command and the cost; for SLURM, writes (and prints) the sbatch script."""
  for run in todo:
    print(shlex.join(spec.main_command(run)))
  _print_cost(sweep, todo)
  if slurm_params is not None and todo:
    os.makedirs(sweep_dir, exist_ok=True)
    path = os.path.join(sweep_dir, "sweep.sbatch")
    script = runner.slurm_script(folder, slurm_params, len(todo))
    with open(path, "w", encoding="utf-8") as f:
      f.write(script)
    print(f"[sweep] sbatch script (not submitted): {path}\n{script}")


def _print_plan(name: str, launched, sweep_dir: str) -> list:
  """Prints what each run (or population) will do; returns those not finished."""
  plans = {run.name: runner.plan(run) for run in launched}
  todo = [run for run in launched if plans[run.name] != "skip"]
  print(f"[sweep] {name}: {len(launched)} runs, {len(launched) - len(todo)} finished, {len(todo)} to run "
        f"in {sweep_dir}")
  for run in launched:
    print(f"[sweep]   {plans[run.name]:<22} {run.name}")
  return todo


def population_sizes(runs, sweep_dir: str, report: bool):
  """`--population_size`: K, or (auto) {a group's first run: K} chosen from the device memory
  (`studies/population_size.py`), its plan printed; for `--report`, the sizes the launch chose."""
  k = sizing.parse_size(FLAGS.population_size)
  if k is not None:
    if FLAGS.population_target or FLAGS.population_device_gib is not None:
      raise spec.SweepError(f"--population_target / --population_device_gib choose the population size; they do "
                            f"not combine with --population_size {k} (drop them, or use --population_size auto)")
    return k
  use = FLAGS.population_memory_use
  if not 0 < use <= 1:
    raise spec.SweepError(f"--population_memory_use must be in (0, 1], got {use:g}")
  if FLAGS.population_device_gib is not None and FLAGS.population_device_gib <= 0:
    raise spec.SweepError(f"--population_device_gib must be > 0, got {FLAGS.population_device_gib:g}")
  cache = sizing.Cache(sweep_dir)
  if report:
    return cache.chosen()
  if FLAGS.population_target:
    gpus = FLAGS.gpus_per_run if FLAGS.executor == "slurm" else 1
    device = sizing.target_device(FLAGS.population_target, gpus, FLAGS.population_device_gib)
  else:
    device = sizing.local_device(FLAGS.population_device_gib)
  groups = spec.population_groups(runs)
  choices = sizing.choose_sizes(groups, device, use, cache)
  print("\n".join(sizing.plan_lines(choices, device)))
  return {group[0].name: c.k for group, c in zip(groups, choices)}


def check_packages(executor: str, dry_run: bool, report: bool) -> None:
  """The optional packages this invocation needs (submitit to run or write an sbatch script,
  matplotlib for the report's figures), checked before anything runs or is written."""
  if not report and not (dry_run and executor == "local"):
    require("submitit", "running a sweep (micse_jax.sweep)")
  if report or (executor == "local" and not dry_run):
    require("matplotlib", "the sweep's figures (micse_jax.sweep report)")


def main(argv):
  """Expands the sweep config and submits, reports or plots its runs (absl main)."""
  cli.reject_extra_args(argv)
  check_packages(FLAGS.executor, FLAGS.dry_run, FLAGS.report)
  logging.getLogger("absl").setLevel(logging.WARNING)  # no tfds INFO lines
  sweep = FLAGS.config
  if FLAGS.step_ms is not None and FLAGS.step_ms <= 0:
    cli.fail(f"--step_ms must be > 0, got {FLAGS.step_ms:g}", cli.USAGE_EXIT)
  sweep_dir = os.path.abspath(FLAGS.sweep_dir or os.path.join("runs", "sweeps", sweep.name))
  sizing.start_backend(FLAGS.population_target)
  try:
    runs = spec.expand(sweep, sweep_dir)
    spec.check_data(runs)
    size = population_sizes(runs, sweep_dir, FLAGS.report)
    launched, runs = spec.group_populations(runs, size, sweep_dir)
  except spec.SweepError as e:
    cli.fail(str(e), cli.USAGE_EXIT)
  if FLAGS.report:
    _report(runs, sweep_dir, sweep.name)
    return
  todo = _print_plan(sweep.name, launched, sweep_dir)
  folder, params = os.path.join(sweep_dir, "submitit"), None
  if FLAGS.executor == "slurm":
    params = runner.slurm_parameters(partition=FLAGS.partition, gpus_per_run=FLAGS.gpus_per_run,
                                     cpus_per_run=FLAGS.cpus_per_run, timeout_min=FLAGS.timeout_min,
                                     max_parallel=FLAGS.max_parallel, account=FLAGS.account,
                                     extra_setup=tuple(FLAGS.setup))
  if FLAGS.dry_run:
    _dry_run(sweep, todo, sweep_dir, folder, params)
    return
  if not todo:
    _report(runs, sweep_dir, sweep.name)
    return
  if FLAGS.executor == "slurm":
    try:
      jobs = runner.submit_slurm(todo, runner.slurm_executor(folder, params))
    except RuntimeError as e:  # e.g. no srun/sbatch on this machine
      cli.fail(str(e), cli.INPUT_EXIT)
    print(f"[sweep] submitted array job {jobs[0].job_id.split('_')[0]} ({len(jobs)} runs); when it is "
          f"done: python -m micse_jax.sweep --config ... --report")
    return
  outcomes = runner.run_local(todo, folder, FLAGS.parallel, FLAGS.timeout_min)
  failed = {name: msg for name, (state, msg) in outcomes.items() if state != "done"}
  _report(runs, sweep_dir, sweep.name)
  if failed:
    print(f"[sweep] {len(failed)} of {len(todo)} runs failed:", file=sys.stderr)
    for name, message in failed.items():
      print(f"[sweep]   {name}: {message}", file=sys.stderr)
    sys.exit(1)


def run() -> None:
  """Entry point (`micse-sweep`): flags and the sweep config are parsed first (a bad one: one line, exit 2)."""
  cli.run_program(main, materialize=lambda: FLAGS.config.to_dict())


if __name__ == "__main__":
  run()
