"""Export a trained encoder as a Hugging Face / sentence-transformers directory.

    python -m micse_jax.convert --workdir DIR [--member I [--allow_stopped]] [--step N | --best] --output HF_DIR [--mlp_as_pooler]
    python -m micse_jax.convert --model HF_DIR_OR_HUB_NAME --output HF_DIR

Add `--overwrite` to replace an existing non-empty output directory.

`--workdir` reads a training run's Orbax checkpoint (the latest one unless `--step`/`--best`);
`--member I` exports member I of a population run (`population.seeds`, numbered from 0; its folder
`DIR/members/I`, which `--workdir DIR/members/I` names as well); a member that stopped (a non-finite
update) is refused however it is named, unless `--allow_stopped`; a population workdir without
`--member` is one line naming its members.
`--model` re-exports a plain Hugging Face checkpoint. See `micse_jax.export` for what the
output holds. Bad input (a `MicseError`) gives one `error:` line on stderr, exit status 1
(a flag that does not parse: exit 2), and writes nothing; anything else is a bug and keeps its
traceback. Installed: `micse-convert`.
"""
from __future__ import annotations

import os

from absl import flags
from absl import logging as absl_logging

from micse_jax import cli
from micse_jax.errors import MicseError, one_line

FLAGS = flags.FLAGS

# The model, checkpoint and export modules (JAX, Flax, Orbax) are imported in the functions that
# use them, so that `--help` and a bad flag combination stay fast.


def define_flags() -> None:
  """Defined only when run as a program, so importing `convert` never clashes with other CLIs."""
  flags.DEFINE_string("workdir", None, "Training workdir to export from.")
  flags.DEFINE_string("model", None,
                      "Hugging Face directory or hub name to export from (instead of --workdir).")
  cli.define_member_flags("Export")
  flags.DEFINE_integer("step", None, "Export the checkpoint of this step (default: the latest).")
  flags.DEFINE_boolean("best", False, "Export the best (STS-B dev) checkpoint.")
  flags.DEFINE_string("output", None, "Output directory for the Hugging Face export.")
  flags.DEFINE_boolean("mlp_as_pooler", False, "Put the trained MLP head into BERT's pooler slot.")
  flags.DEFINE_boolean("overwrite", False, "Replace an existing non-empty output directory.")
  flags.DEFINE_integer("max_seq_length", None, "sentence-transformers max_seq_length (default 128).")


class ConvertError(MicseError):
  """The command line or its inputs do not allow an export."""


def checkpoint_choice(step: int | None, best: bool) -> str | int:
  """'latest', 'best' or a step number, from `--step` / `--best`."""
  if step is not None and best:
    raise ConvertError("--step and --best are mutually exclusive")
  if step is not None and step < 0:
    raise ConvertError(f"--step must be >= 0, got {step}")
  return step if step is not None else ("best" if best else "latest")


def check_args(*, output: str | None, workdir: str | None, model: str | None, step: int | None,
               best: bool, mlp_as_pooler: bool) -> str | int | None:
  """Validates the flag combination; returns the checkpoint choice for `--workdir`."""
  if not output:
    raise ConvertError("--output is required")
  if (workdir is None) == (model is None):
    raise ConvertError("give exactly one of --workdir or --model")
  if model is not None:
    if step is not None or best:
      raise ConvertError("--step/--best select a workdir checkpoint; they do not apply to --model")
    if mlp_as_pooler:
      raise ConvertError("--mlp_as_pooler needs a trained MLP head, which only a --workdir has")
    return None
  return checkpoint_choice(step, best)


def restore_workdir(workdir: str, which: str | int, member: int | None = None, allow_stopped: bool = False) -> dict:
  """`micse_jax.workdir.restore_trained_weights` of one run: the workdir, or member `member` of a
  population workdir. A population workdir without `--member`, and a stopped member however it is
  named (`--member i` or its folder) unless `allow_stopped` (then saying from which step), are
  refused in one line (`workdir.one_run`); its input errors (`MicseError`) as one line."""
  if not os.path.isdir(workdir):
    raise ConvertError(f"workdir does not exist: {workdir}")
  from micse_jax import workdir as workdir_lib
  try:
    workdir = workdir_lib.member_workdir(workdir, member, allow_stopped) if member is not None \
        else workdir_lib.one_run(workdir, allow_stopped)
  except MicseError as e:
    raise ConvertError(one_line(e)) from e
  stopped = workdir_lib.member_stopped(workdir)
  if stopped is not None:
    print(f"{_member_name(workdir_lib, workdir)} stopped at step {stopped} (a non-finite update; "
          f"{workdir_lib.STOPPED_STATE}): exporting that state, not a finished run")
  try:
    return workdir_lib.restore_trained_weights(workdir, which, allow_stopped=allow_stopped)
  except MicseError as e:  # anything else is a bug and keeps its traceback
    raise ConvertError(f"cannot restore checkpoint {which!r} from {workdir}: {one_line(e)}") from e


def _member_name(workdir_lib, folder: str) -> str:
  population = workdir_lib.member_of(folder)
  return f"member {population[1]}" if population else f"the member in {folder}"


def load_model_dir(path_or_name: str) -> dict:
  """A plain HF checkpoint in the shape `restore_trained_weights` returns.

  A checkpoint without pooler weights (e.g. a `BertForMaskedLM`) loads with a random pooler;
  that one is dropped so the export gets the documented all-zero pooler instead.
  """
  from micse_jax.models.loading import load_pretrained
  _, params, config, model_dir = load_pretrained(path_or_name)
  if not _has_pooler_weights(model_dir):
    params = {k: v for k, v in params.items() if k != "pooler"}
  return {"bert_config": config, "encoder_params": params, "head_params": None, "tokenizer_dir": model_dir}


def _has_pooler_weights(model_dir: str) -> bool:
  """Whether the checkpoint in `model_dir` stores pooler weights (safetensors: names only)."""
  from safetensors import safe_open

  from micse_jax.models import loading, weights
  st_path = os.path.join(model_dir, "model.safetensors")
  if os.path.isfile(st_path):
    with safe_open(st_path, framework="numpy") as f:
      names = list(f.keys())
  else:
    names = list(loading.load_hf_state_dict(model_dir))
  return any(weights.normalize_hf_name(n).startswith("pooler.") for n in names)


def convert(*, output: str, workdir: str | None = None, model: str | None = None, step: int | None = None,
            best: bool = False, mlp_as_pooler: bool = False, overwrite: bool = False,
            max_seq_length: int | None = None, member: int | None = None, allow_stopped: bool = False) -> str:
  """Checks everything cheap first, then restores/loads and exports; returns the output path."""
  from micse_jax import export
  which = check_args(output=output, workdir=workdir, model=model, step=step, best=best,
                     mlp_as_pooler=mlp_as_pooler)
  if member is not None and (workdir is None or member < 0):
    raise ConvertError(f"--member must be >= 0 and needs --workdir, got --member {member}")
  output = os.path.abspath(os.path.expanduser(output))
  export.check_output(output, overwrite)
  source = load_model_dir(model) if model is not None else restore_workdir(workdir, which, member, allow_stopped)
  return export.export_hf(
      output, bert_config=source["bert_config"], encoder_params=source["encoder_params"],
      tokenizer_dir=source["tokenizer_dir"], head_params=source.get("head_params"),
      mlp_as_pooler=mlp_as_pooler, overwrite=overwrite, max_seq_length=max_seq_length)


def main(argv):
  """Exports the checkpoint the flags name to a HF / sentence-transformers directory (absl main)."""
  cli.reject_extra_args(argv)
  if not FLAGS["verbosity"].present:  # keep stderr to warnings and the one error line
    absl_logging.set_verbosity(absl_logging.WARNING)
  convert_and_report(output=FLAGS.output, workdir=FLAGS.workdir, model=FLAGS.model, step=FLAGS.step,
                     best=FLAGS.best, mlp_as_pooler=FLAGS.mlp_as_pooler, overwrite=FLAGS.overwrite,
                     max_seq_length=FLAGS.max_seq_length, member=FLAGS.member, allow_stopped=FLAGS.allow_stopped)


def convert_and_report(**kwargs) -> str:
  """`convert(**kwargs)` with bad input as one `error:` line and exit 1 (nothing written)."""
  with cli.input_errors_as_one_line():
    out = convert(**kwargs)
  print(f"exported to {out}")
  return out


def run() -> None:
  """Entry point: `python -m micse_jax.convert ...` or `micse-convert ...`."""
  cli.run_program(main, define_flags)


if __name__ == "__main__":
  run()
