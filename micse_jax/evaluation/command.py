"""Evaluate a sentence encoder on SentEval STS and transfer tasks (SimCSE / miCSE protocol).

  python -m micse_jax.evaluate --model PATH --tasks sts --pooler cls_before_pooler \
      --output results.json

`--transfer_protocol`: `senteval` (default; SentEval's own classifier, the protocol of the SimCSE /
miCSE papers; `--fast` is SimCSE's `fasttest`) or `logreg` (exact logistic regression).
`--model` is a Hugging Face directory, a hub name or a training workdir (`--checkpoint`); with
`--member I`, member I of a population workdir (numbered from 0 in the order of `population.seeds`;
`--model DIR/members/I` is the same); a stopped member is refused however it is named, unless
`--allow_stopped`.
`--tasks`: `sts`, `transfer`, `all` or a comma list (STS12 ... STS16, STSBenchmark/STS-B,
SICKRelatedness/SICK-R, MR, CR, SUBJ, MPQA, SST2, TREC, MRPC). Bad input (a `MicseError`) is
reported as one line on stderr with exit code 1 (a flag that does not parse: exit 2), and no
output file is written; anything else is a bug and keeps its traceback. Installed: `micse-evaluate`.

The evaluation itself is `micse_jax.evaluation.runner.run_evaluation(encode_fn, senteval_dir,
tasks, fast)`; this module is its command-line shell (run by `micse_jax/evaluate.py`) and defines
its flags only when run as a program.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from absl import flags, logging

from micse_jax import cli, paths
from micse_jax.errors import ConfigError, ModelLoadError
from micse_jax.evaluation import report, senteval_data
from micse_jax.evaluation.runner import run_evaluation
from micse_jax.pooling import POOLERS

# `workdir` and `encoder` (Flax, Orbax) are imported where a model is read, so that `--help` and
# the checks of the flags stay fast.

PROTOCOLS = senteval_data.TRANSFER_PROTOCOLS

SEED = senteval_data.SEED


def _looks_local(path: str) -> bool:
  return path.startswith(("/", "./", "../", "~")) or os.path.exists(path)


def _transfer_protocol(values) -> str:
  """`--transfer_protocol` (`senteval` where the caller's namespace has none)."""
  return getattr(values, "transfer_protocol", "senteval")


def _check_inputs(flags_values) -> tuple[list[str], str, str]:
  """Validates tasks, pooler, checkpoint, output folder, model and data dir; returns (tasks, data
  dir, the model's path: `_model_path`)."""
  try:
    tasks = senteval_data.resolve_tasks(flags_values.tasks)
  except ValueError as e:
    raise ConfigError(f"--tasks: {e}") from e
  protocol = _transfer_protocol(flags_values)
  if protocol not in PROTOCOLS:
    raise ConfigError(f"unknown --transfer_protocol {protocol!r}; "
                      f"expected one of {', '.join(PROTOCOLS)}")
  if flags_values.pooler not in POOLERS:
    raise ConfigError(f"unknown pooler {flags_values.pooler!r}; expected one of "
                     f"{', '.join(POOLERS)}")
  if flags_values.checkpoint not in ("best", "latest") and not flags_values.checkpoint.isdigit():
    raise ConfigError(f"--checkpoint must be best, latest or a step number, "
                     f"not {flags_values.checkpoint!r}")
  if flags_values.output:
    folder = os.path.dirname(os.path.abspath(flags_values.output))
    if not os.path.isdir(folder):
      raise ConfigError(f"output folder does not exist: {folder}")
  model = os.path.expanduser(flags_values.model or "")
  if not model:
    raise ConfigError("--model is required (a HF model directory, hub name or training workdir)")
  if _looks_local(model) and not os.path.exists(model):
    raise ModelLoadError(f"model path not found: {model}")
  model_path = _model_path(flags_values)  # --member names an existing member
  senteval_dir = flags_values.senteval_dir or paths.senteval_dir()
  if flags_values.download and not os.path.isdir(senteval_dir):
    print(f"downloading SentEval data to {senteval_dir} ...", file=sys.stderr)
    senteval_data.download_senteval(senteval_dir)
  senteval_data.validate_tasks(senteval_dir, tasks)  # data errors before the model loads
  return tasks, senteval_dir, model_path


def _model_path(flags_values) -> str:
  """`--model`, or with `--member I` the folder of member I of that population workdir; a population
  workdir without `--member`, or a stopped member however named (unless `--allow_stopped`), is
  one line (`workdir.one_run`)."""
  from micse_jax import workdir
  model, member = os.path.expanduser(flags_values.model), getattr(flags_values, "member", None)
  if member is None:
    return workdir.one_run(model, _allow_stopped(flags_values))
  if member < 0:
    raise ConfigError(f"--member must be >= 0, got {member}")
  return workdir.member_workdir(model, member, allow_stopped=_allow_stopped(flags_values))


def _allow_stopped(flags_values) -> bool:
  return getattr(flags_values, "allow_stopped", False)


def _encode_fn(flags_values, model_path: str):
  """Loads the encoder at `model_path` (`_check_inputs`) and returns its encode function."""
  from micse_jax.encoder import load_encoder
  checkpoint = flags_values.checkpoint
  checkpoint = int(checkpoint) if checkpoint.isdigit() else checkpoint
  encoder = load_encoder(model_path, checkpoint=checkpoint, allow_stopped=_allow_stopped(flags_values))
  return lambda sentences: encoder.encode(sentences, pooler=flags_values.pooler,
                                          batch_size=flags_values.batch_size,
                                          max_length=flags_values.max_length)


def main(argv: Sequence[str]) -> None:
  """Evaluates the model the flags name and reports the scores (absl main)."""
  logging.set_verbosity(logging.WARNING)
  cli.reject_extra_args(argv)
  evaluate_and_report(flags.FLAGS)


def evaluate_and_report(values) -> dict:
  """Validates the flag values, loads the model, evaluates, writes the JSON and prints the
  tables; bad input is one `error:` line and exit 1 (nothing written)."""
  with cli.input_errors_as_one_line():
    tasks, senteval_dir, model_path = _check_inputs(values)
    results = run_evaluation(_encode_fn(values, model_path), senteval_dir, tasks, fast=values.fast,
                             seed=values.seed, transfer_protocol=_transfer_protocol(values))
  document = report.build_report(
      results, model=values.model, pooler=values.pooler,
      settings={**results["settings"], "batch_size": values.batch_size,
                "max_length": values.max_length, "checkpoint": values.checkpoint},
      elapsed_seconds=results["elapsed_seconds"])
  if values.output:
    report.write_json(values.output, document)
  print(report.markdown_table(results))
  print(f"elapsed: {results['elapsed_seconds']:.1f} s", file=sys.stderr)
  return document


def define_flags() -> None:
  """The CLI flags (defined on demand so that importing this module defines none)."""
  flags.DEFINE_string("model", None, "HF model directory, hub name or training workdir.")
  flags.DEFINE_string("senteval_dir", None,
                      "SentEval data/downstream directory (default: $MICSE_DATA_DIR/senteval, "
                      "else shared/data/senteval in or above the working directory).")
  flags.DEFINE_string("tasks", "sts", "sts, transfer, all, or a comma list of task names.")
  flags.DEFINE_string("pooler", "cls_before_pooler", f"One of {', '.join(POOLERS)}.")
  flags.DEFINE_string("output", None, "Write the JSON report here (atomically).")
  flags.DEFINE_boolean("fast", False, "Transfer tasks with fewer folds (quick checks; senteval "
                       "protocol: SimCSE's fasttest).")
  flags.DEFINE_string("transfer_protocol", "senteval",
                      "Transfer classifier: senteval (SentEval's, the papers') or logreg.")
  flags.DEFINE_integer("batch_size", 64, "Encoding batch size.")
  flags.DEFINE_integer("max_length", 512, "Token limit per sentence (longer ones are truncated).")
  flags.DEFINE_boolean("download", False, "Download SentEval data if --senteval_dir is missing.")
  flags.DEFINE_string("checkpoint", "best", "For a training workdir: best, latest or a step.")
  cli.define_member_flags("Evaluate")
  flags.DEFINE_integer("seed", SEED, "Seed of the transfer-task folds (SentEval: 1111).")


def run() -> None:
  """Entry point: `python -m micse_jax.evaluate ...` or `micse-evaluate ...`."""
  cli.run_program(main, define_flags)


if __name__ == "__main__":
  run()
