"""A training workdir's on-disk contract, read by inference, evaluation and export without
importing the trainer: the layout, the Orbax managers, the best-metric key, the run summary.

    workdir/config.json           the training config (+ resolved model dir and BERT config)
    workdir/checkpoints/<step>/   rolling Orbax TrainStates (written by `training/checkpoint.py`)
    workdir/best/<step>/          {'params': ...} of the best STS-B dev score (`BEST_METRIC`)
    workdir/results.json          final evaluation of the best checkpoint
    workdir/tensorboard/          training and dev-score scalars
    workdir/timeline.json         seconds per phase, one entry per session (`micse_jax/timeline.py`)

A population workdir (`population.seeds`, `training/population.py`) holds the members' stacked
train states in `checkpoints/` (`{'step', 'members': TrainState with a leading member axis,
'stopped_at'}`) and one folder per member, numbered from 0 in the order of `population.seeds`:

    workdir/members/<i>/config.json   the member's solo config (seed = seeds[i], its subset)
    workdir/members/<i>/best/ results.json timeline.json tensorboard/   as in a solo workdir
    workdir/members/<i>/stopped.json  only if the member stopped (a non-finite update): the step

A member folder reads like a solo workdir (`is_workdir`, `restore_params`): its rolling
checkpoints are member i's slice of the population's (`member_of`). A stopped member's state is
kept as before the step it stopped at: `one_run` refuses it unless asked (`allow_stopped`),
however it is named (`--member i` or its folder), and the run summary names it. A population
workdir itself is no one run: `one_run` says so, with the `--member` values it has.
"""
from __future__ import annotations

import contextlib
import logging
import os

import jax
import orbax.checkpoint as ocp

from micse_jax import jsonio, timeline
from micse_jax.errors import CheckpointError, one_line
from micse_jax.models.bert import BertConfig

CONFIG_FILE = "config.json"
ROLLING_DIR = "checkpoints"
BEST_DIR = "best"
RESULTS_FILE = "results.json"
TENSORBOARD_DIR = "tensorboard"
TIMELINE_FILE = "timeline.json"
MEMBERS_DIR = "members"
STOPPED_FILE = "stopped.json"
BEST_METRIC = "stsb_dev"  # the metric the best checkpoint is chosen by (STS-B dev Spearman x100)
STOPPED_STATE = "its state is kept as before that step"  # what a stopped member's checkpoints hold, in every message


def has_steps(directory: str) -> bool:
  """Whether a checkpoint folder (`checkpoints/` or `best/`) holds at least one saved step."""
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def is_workdir(path: str) -> bool:
  """A folder with `config.json` and `checkpoints/` (what the trainer writes), or a population member's folder."""
  if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
    return False
  return os.path.isdir(os.path.join(path, ROLLING_DIR)) or member_of(path) is not None


def member_dir(workdir: str, index: int) -> str:
  """`workdir/members/<index>/`, the folder of population member `index` (numbered from 0)."""
  return os.path.join(os.path.abspath(workdir), MEMBERS_DIR, str(index))


def population_seeds(workdir: str) -> list[int]:
  """The `population.seeds` of a workdir's config.json ([] for a solo run or no workdir)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    return []
  return list(jsonio.read_json(path).get("population", {}).get("seeds", []) or [])


def member_workdir(workdir: str, index: int, allow_stopped: bool = False) -> str:
  """The member folder `--member index` names; CheckpointError (one line) when there is none, or
  when the member stopped (a non-finite update) and `allow_stopped` is False (`one_run`)."""
  seeds = population_seeds(workdir)
  if not seeds:
    raise CheckpointError(f"{workdir} is not a population workdir (its {CONFIG_FILE} has no population.seeds); "
                          "--member applies only to population runs")
  if not 0 <= index < len(seeds):
    raise CheckpointError(f"--member {index} out of range: {workdir} has {len(seeds)} members ({_member_range(seeds)})")
  path = member_dir(workdir, index)
  if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
    raise CheckpointError(f"member {index} of {workdir} has no {CONFIG_FILE} (the run did not start?)")
  return one_run(path, allow_stopped)


def _member_range(seeds) -> str:
  """The `--member` values of a population of these seeds: "0", "0 or 1", "0..k-1"."""
  return {1: "0", 2: "0 or 1"}.get(len(seeds), f"0..{len(seeds) - 1}")


def one_run(path: str, allow_stopped: bool = False) -> str:
  """`path` when its weights are one run's to use (a solo workdir, a member folder, a HF folder or
  hub name); CheckpointError (one line) for a population workdir (which member?) and for a member
  that stopped (a non-finite update), however its folder is named, unless `allow_stopped`."""
  seeds = population_seeds(path) if os.path.isdir(os.path.join(path, ROLLING_DIR)) else []
  if seeds:
    raise CheckpointError(
        f"{path} is a population workdir ({len(seeds)} members, population.seeds {tuple(seeds)}): choose one "
        f"member with --member {_member_range(seeds)} (or name its folder, {os.path.join(path, MEMBERS_DIR, '<i>')})")
  stopped = member_stopped(path)
  if stopped is not None and not allow_stopped:
    population = member_of(path)
    who = f"member {population[1]} of {population[0]}" if population else f"the population member in {path}"
    raise CheckpointError(f"{who} stopped at step {stopped} (a non-finite loss, gradient or params; {STOPPED_STATE}), "
                          "not a finished run; pass --allow_stopped to use that state anyway")
  return path


def record_member_stopped(folder: str, step: int, reason: str) -> None:
  """Records in a member's folder that it stopped at `step` (`reason`: the line that reported it)."""
  jsonio.write_json(os.path.join(folder, STOPPED_FILE), {"stopped_at_step": int(step), "reason": reason})


def clear_member_stopped(folder: str) -> None:
  """Removes a member's stop record (a resumed run in which it trains again)."""
  if os.path.isfile(os.path.join(folder, STOPPED_FILE)):
    os.remove(os.path.join(folder, STOPPED_FILE))


def member_stopped(folder: str) -> int | None:
  """The step a member stopped at (its folder's `STOPPED_FILE`), None while it trains or trained to the end."""
  path = os.path.join(folder, STOPPED_FILE)
  return int(jsonio.read_json(path)["stopped_at_step"]) if os.path.isfile(path) else None


def member_of(path: str) -> tuple[str, int] | None:
  """(population workdir, member index) when `path` is `W/members/<i>` of a population workdir W."""
  path = os.path.abspath(path)
  parent, name = os.path.split(path)
  if os.path.basename(parent) != MEMBERS_DIR or not name.isdigit():
    return None
  workdir = os.path.dirname(parent)
  if int(name) >= len(population_seeds(workdir)) or not os.path.isdir(os.path.join(workdir, ROLLING_DIR)):
    return None
  return workdir, int(name)


def write_run_config(workdir: str, config_dict: dict) -> None:
  """Writes config.json atomically."""
  jsonio.write_json(os.path.join(workdir, CONFIG_FILE), config_dict, sort_keys=True)


def read_run_config(workdir: str) -> dict:
  """The run's config.json (CheckpointError when the folder is not a training workdir)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise CheckpointError(f"{workdir} is not a training workdir (no {CONFIG_FILE})")
  return jsonio.read_json(path)


def _read_only_notice(record: logging.LogRecord) -> bool:
  """False for Orbax's warnings that a read-only manager is read-only (what was asked for)."""
  message = record.getMessage()
  return not (record.levelno < logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname
              and ("read only" in message or "read_only=True" in message))


@contextlib.contextmanager
def _quiet_read_only(read_only: bool):
  """Opens a manager without Orbax's read-only notices (three warnings per `load_encoder` otherwise)."""
  logger = logging.getLogger("absl")
  if read_only:
    logger.addFilter(_read_only_notice)
  try:
    yield
  finally:
    logger.removeFilter(_read_only_notice)


def rolling_manager(workdir: str, keep: int, read_only: bool = False) -> ocp.CheckpointManager:
  """The Orbax manager of `checkpoints/`: full train states, the last `keep` kept, written without
  compression (a rolling state is soon replaced: the writer's time matters more than its bytes;
  older compressed ones read alike). Saves and restores take `ocp.args.PyTreeSave` / `PyTreeRestore`."""
  with _quiet_read_only(read_only):
    return ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), ROLLING_DIR), item_handlers=ocp.PyTreeCheckpointHandler(
            use_compression=False),
        options=ocp.CheckpointManagerOptions(max_to_keep=None if read_only else keep,
                                             create=not read_only, read_only=read_only))


def best_manager(workdir: str, read_only: bool = False) -> ocp.CheckpointManager:
  """The Orbax manager of `best/`: the params of the best `BEST_METRIC` so far (keep 1)."""
  with _quiet_read_only(read_only):
    return ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), BEST_DIR),
        options=ocp.CheckpointManagerOptions(max_to_keep=None if read_only else 1,
                                             create=not read_only, read_only=read_only,
                                             best_mode="max", best_fn=lambda metrics: metrics[BEST_METRIC]))


def step_reader(directory: str) -> ocp.CheckpointManager:
  """A read-only manager that can open any step's saved tree (no registered save args needed)."""
  with _quiet_read_only(True):
    return ocp.CheckpointManager(
        os.path.abspath(directory), item_handlers=ocp.PyTreeCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0))


def current_device_sharding() -> jax.sharding.Sharding:
  """Where restored arrays land when nothing else is asked for: this process's first device."""
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def abstract_on(metadata_tree, sharding: jax.sharding.Sharding):
  """The saved arrays' shapes and dtypes as `ShapeDtypeStruct`s placed on `sharding`.

  Restoring onto an explicit target sharding, instead of the one stored in the checkpoint,
  is what makes a checkpoint readable on any device or host count.
  """
  def leaf(meta):
    return jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=sharding) if hasattr(meta, "shape") else meta
  return jax.tree.map(leaf, metadata_tree)


def read_subtree(directory: str, step: int, key: str = "params", sharding=None):
  """One top-level entry (`params`) of a saved state, placed on `sharding` (default: this
  process's first device). Only that entry is read: never the optimizer state or the queue;
  nothing else of the saved tree needs to be known. Orbax/TensorStore errors propagate.
  """
  reader = step_reader(directory)
  path = key.split("/")  # "members/params": a population's stacked params
  try:
    tree = getattr(reader.item_metadata(step), "tree", None)
    for part in path:
      if not isinstance(tree, dict) or part not in tree:
        raise CheckpointError(f"checkpoint step {step} in {directory} holds no {key!r}")
      tree = tree[part]
    target = abstract_on(tree, sharding or current_device_sharding())
    for part in reversed(path):
      target = {part: target}
    restored = reader.restore(step, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    for part in path:
      restored = restored[part]
    return restored
  finally:
    reader.close()


def unreadable_reason(e: BaseException) -> str:
  """A short one-line reason from an Orbax/TensorStore error (their specs run to kilobytes)."""
  text = one_line(e).split(" [tensorstore_spec")[0]
  return text if len(text) <= 300 else text[:297] + "..."


def restore_subtree(directory: str, step: int, key: str = "params", sharding=None):
  """`read_subtree`, any failure as a one-line CheckpointError."""
  try:
    return read_subtree(directory, step, key, sharding)
  except CheckpointError:
    raise
  except Exception as e:  # Orbax, TensorStore and file errors alike: the checkpoint is unreadable
    raise CheckpointError(f"checkpoint step {step} in {directory} is unreadable: {unreadable_reason(e)}") from e


def restore_params(workdir: str, which: str | int = "latest", sharding=None,
                   key: str = "params") -> tuple[int, dict]:
  """(step, params) of a workdir checkpoint, on the current devices whatever the training topology.

  which = 'best', 'latest' or a step number. An unreadable latest checkpoint falls back to the
  newest readable one with a warning; an unreadable 'best' or explicit step raises CheckpointError.
  A population member's folder reads its slice of the population's checkpoints (`member_of`).
  """
  population = member_of(workdir) if which != "best" else None
  if population is not None:  # member i's slice of the population's rolling checkpoints
    step, params = restore_params(population[0], which, sharding, key="members/params")
    return step, jax.tree.map(lambda x: x[population[1]], params)
  directory = os.path.join(os.path.abspath(workdir), BEST_DIR if which == "best" else ROLLING_DIR)
  kind = "best" if which == "best" else "rolling"
  steps = sorted(ocp.utils.checkpoint_steps(directory)) if os.path.isdir(directory) else []
  if not steps:
    raise CheckpointError(f"no {kind} checkpoint in {workdir}")
  if which not in ("latest", "best"):
    if int(which) not in steps:
      raise CheckpointError(f"no checkpoint at step {which} in {workdir} (have {steps})")
    return int(which), restore_subtree(directory, int(which), key, sharding)
  if which == "best":
    return steps[-1], restore_subtree(directory, steps[-1], key, sharding)
  return newest_readable(steps, lambda step: read_subtree(directory, step, key, sharding), directory)


def newest_readable(steps, restore_fn, directory: str):
  """(step, restore_fn(step)) for the newest step that restores; warns about each one skipped.

  Raises CheckpointError (one line, naming the newest failure) when none can be read.
  """
  if not steps:
    raise CheckpointError(f"no checkpoint in {directory}")
  failures = []
  for step in sorted(steps, reverse=True):
    try:
      result = restore_fn(step)
    except Exception as e:
      failures.append(f"step {step}: {unreadable_reason(e)}")
      logging.warning("checkpoint step %d in %s is unreadable (%s); trying an older one",
                      step, directory, unreadable_reason(e))
      continue
    if failures:
      logging.warning("falling back to checkpoint step %d in %s", step, directory)
    return step, result
  raise CheckpointError(f"no checkpoint in {directory} could be restored (newest: {failures[0]})")


def restore_trained_weights(workdir: str, which: str | int = "latest", allow_stopped: bool = False) -> dict:
  """Trained weights of a workdir: which = 'latest', 'best' or a step number; a population workdir
  or a stopped member (unless `allow_stopped`) is refused in one line (`one_run`).

  Works on any device/host count (see `restore_params`). Returns {'bert_config',
  'encoder_params', 'head_params', 'tokenizer_dir', 'step'} as numpy arrays.
  """
  one_run(workdir, allow_stopped)
  run = read_run_config(workdir)
  step, params = restore_params(workdir, which)
  params = jax.device_get(params)
  return {"bert_config": BertConfig.from_dict(run["bert_config"]), "encoder_params": params["encoder"],
          "head_params": params["head"], "tokenizer_dir": run["model_dir"], "step": step}


def run_summary(workdir: str) -> list[str]:
  """Lines naming the best STS-B dev score and step, results.json, the best checkpoint,
  the TensorBoard logs and the export command (paths absolute, so they can be pasted)."""
  wd = os.path.abspath(workdir)
  lines = [f"run finished: {wd}"]
  best_dir = os.path.join(wd, BEST_DIR)
  manager, best_step = None, None
  if has_steps(best_dir):
    manager = best_manager(wd, read_only=True)
    best_step = manager.best_step()
  if best_step is not None:
    score = float(manager.metrics(best_step)[BEST_METRIC])
    lines.append(f"  best STS-B dev:   {score:.2f} at step {best_step}")
    lines.append(f"  best checkpoint:  {os.path.join(best_dir, str(best_step))}")
  else:
    lines.append("  best STS-B dev:   none (no dev selection: eval_every=0 or no SentEval data)")
  results = os.path.join(wd, RESULTS_FILE)
  lines.append(f"  results:          {results if os.path.isfile(results) else 'none (eval.final_tasks empty or no SentEval data)'}")
  lines.append(f"  TensorBoard logs: tensorboard --logdir {os.path.join(wd, TENSORBOARD_DIR)}")
  timeline_path = os.path.join(wd, TIMELINE_FILE)
  if os.path.isfile(timeline_path):
    document = jsonio.read_json(timeline_path)
    lines.append(f"  timeline:         {timeline.one_line(document)}")
    loop = timeline.loop_line(document)
    if loop:
      lines.append(f"  loop:             {loop}")
  which = " --best" if best_step is not None else ""
  lines.append(f"  export:           python -m micse_jax.convert --workdir {wd}{which} --output EXPORT_DIR")
  return lines


def population_summary(workdir: str) -> list[str]:
  """Per member of a population workdir: its best STS-B dev score and the export command."""
  wd, lines = os.path.abspath(workdir), []
  for i, seed in enumerate(population_seeds(wd)):
    folder = member_dir(wd, i)
    best_step = best_manager(folder, read_only=True).best_step() if has_steps(os.path.join(folder, BEST_DIR)) else None
    score = (f"best STS-B dev {float(best_manager(folder, read_only=True).metrics(best_step)[BEST_METRIC]):.2f} "
             f"at step {best_step}" if best_step is not None else "no dev selection")
    which = " --best" if best_step is not None else ""
    stopped = member_stopped(folder)
    state = "" if stopped is None else f"STOPPED at step {stopped} (a non-finite update; {STOPPED_STATE}); "
    flag = "" if stopped is None else " --allow_stopped"
    lines.append(f"  member {i} (seed {seed}): {state}{score}; {folder}; export: python -m micse_jax.convert "
                 f"--workdir {wd} --member {i}{which}{flag} --output EXPORT_DIR")
  return lines


def print_run_summary(workdir: str) -> None:
  """Prints `run_summary` on the first process."""
  if jax.process_index() == 0:
    members = population_summary(workdir)
    lines = run_summary(workdir) if not members else [f"population finished: {os.path.abspath(workdir)}", *members]
    timeline_path = os.path.join(workdir, TIMELINE_FILE)
    if members and os.path.isfile(timeline_path):
      lines.append(f"  timeline (all members): {timeline.one_line(jsonio.read_json(timeline_path))}")
    print("\n".join(lines), flush=True)
