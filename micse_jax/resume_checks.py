"""Whether a workdir's checkpoints resume under a new config, and what a change that may resume does.

A workdir that holds checkpoints resumes only the run that wrote them: the same model, data and
objective (`config_differences` names every other difference; `check_resume_compatible` refuses
them in one line, before anything is written). Some fields may change (`RESUMABLE_CHANGES`): how
long the run goes, how often it logs, evaluates and saves, how the same step is laid out in memory,
where the caches live, and the generator of the dropout bits. Two of those change what the steps
after the checkpoint compute (`RESUME_NOTES`: where the learning rate's decay ends, which generator
draws the dropout masks); such a change resumes with one warning line saying so (`resume_notes`,
returned by `check_resume_compatible` and printed by the trainer once it has resumed).
"""
from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from micse_jax import workdir as workdir_lib
from micse_jax.configs import population_fields
from micse_jax.errors import ConfigError

# Fields that may change when a run is resumed (how long it runs, how often it logs, evaluates
# and saves; how the same step is laid out in memory: remat, attention kernel, sharded state, GradCache's
# blocks (`chunk_size`: the unblocked step to float rounding; a checkpoint knows nothing of blocks);
# where the caches live; the dropout generator, which the train state's threefry key seeds whatever
# it is); any other difference would silently continue a different run. A missing field of an old
# config.json is such a difference unless it is listed here.
RESUMABLE_CHANGES = ("num_train_steps", "log_every", "checkpoint_every", "keep_checkpoints",
                     "eval_every", "steps_per_dispatch", "chunk_size", "eval.", "data.prefetch", "model.remat",
                     "model.attention", "mesh.", "cache.", "model.rng_impl")
# Fields added after workdirs were first written, each with the value that does what the versions
# before it did: an old config.json without the field resumes when the config holds that value
# (any other value is a different run, refused like any difference).
ADDED_FIELDS = {"model.rng_impl": "threefry", **population_fields.DEFAULTS}
# Resumable changes that change what the steps after the checkpoint compute: each is one warning line.
RESUME_NOTES = {
    "num_train_steps": "the learning rate's linear decay to 0 now ends at step {new} instead of {old} "
                       "(optim.learning_rate_schedule), so every step after the checkpoint trains at another "
                       "learning rate than the run that saved it planned",
    "model.rng_impl": "the dropout masks of the steps after the checkpoint are drawn by {new} instead of {old} "
                      "(the train state's threefry key seeds either), so the run equals neither generator's "
                      "uninterrupted run bit for bit",
}


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  flat = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      flat.update(_flatten(v, f"{prefix}{k}."))
    else:
      flat[f"{prefix}{k}"] = v
  return flat


def config_differences(saved: dict, config_dict: dict) -> list[str]:
  """`field (saved → new)` for every run-defining field that differs (JSON-normalised)."""
  new = _flatten(json.loads(json.dumps(config_dict)))
  old = _flatten({k: v for k, v in saved.items() if k not in ("model_dir", "bert_config")})
  differences = []
  for field in sorted(set(new) | set(old)):
    if field.startswith(RESUMABLE_CHANGES) or old.get(field) == new.get(field):
      continue
    if field not in old and new.get(field) == ADDED_FIELDS.get(field, "<none>"):
      continue  # written before the field existed: what that version did
    differences.append(f"{field} ({old.get(field, '<absent>')!r} -> {new.get(field, '<absent>')!r})")
  return differences


def resume_notes(saved: dict, config_dict: dict) -> list[str]:
  """One line per `RESUME_NOTES` field whose value differs from the saved run's (a field an old
  config.json lacks read as `ADDED_FIELDS` gives it): the change and what it does to the steps left."""
  old, new = _flatten(saved), _flatten(json.loads(json.dumps(config_dict)))
  lines = []
  for field, consequence in RESUME_NOTES.items():
    before, after = old.get(field, ADDED_FIELDS.get(field)), new.get(field)
    if before is not None and after is not None and before != after:
      lines.append(f"{field} changes on resume ({before!r} -> {after!r}): "
                   + consequence.format(old=before, new=after))
  return lines


def check_resume_compatible(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """A workdir with checkpoints resumes only a run with the same model, data and objective
  (`ConfigError` otherwise); returns what a resumable change does (`resume_notes`, [] for a new run)."""
  if not workdir_lib.has_steps(os.path.join(workdir, workdir_lib.ROLLING_DIR)):
    return []
  saved = workdir_lib.read_run_config(workdir)
  if "shuffle" not in saved.get("data", {}):
    raise ConfigError(
        f"{workdir} holds checkpoints of a run whose batches were ordered by grain's shuffle (written "
        "before data.shuffle existed); this version orders batches by NumPy epoch permutations and "
        "cannot continue that run bit for bit. Start a new --workdir, or resume with the version that wrote it")
  differences = config_differences(saved, config.to_dict())
  if differences:
    raise ConfigError(
        f"{workdir} holds checkpoints of a different run; differing fields: {', '.join(differences)}. "
        "To start fresh, pass a new --workdir (or delete this one); to resume, use its config.json values")
  return resume_notes(saved, config.to_dict())
