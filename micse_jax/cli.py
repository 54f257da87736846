"""What the command-line programs share: one skeleton (`run_program`), quiet start-up, flag
parsing, one-line errors.

Every program (`micse-train`, `micse-evaluate`, `micse-convert`, `micse-sweep`,
`micse-prepare-data`, `micse-analyze`) is a module with absl flags, a `main(argv)` and
`run() = cli.run_program(main, ...)`, the console-script entry point and `__main__`.

`--help` (`-?`, `--helpshort`, `--helpfull`, `--helpxml`) prints the flags and exits 0. A
`--config.FIELD=VALUE` override is one whole value, for every field: given twice, the last one
replaces the first (ml_collections would concatenate a repeated tuple field's values, so adding an
override to a command that has one would train another run than the one asked for).

The rule: bad input (a `MicseError`, or a flag/override that does not parse) is reported as
one `error: ...` line on stderr with a non-zero exit; anything else is a bug and keeps its
traceback. Errors are caught only while flags are parsed and around the `MicseError`-raising
library call, never around the whole program, with one exception: a `MissingDependencyError`
(an optional package that is not installed, `micse_jax.optional.require`) is never a bug, so
`run_program` turns it into one line (exit 1) wherever in the program it is raised.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import pkgutil
import sys
from importlib.metadata import entry_points
from typing import Callable, Iterator, NoReturn, Sequence

from absl import app, flags

from micse_jax import configs
from micse_jax.errors import MicseError, MissingDependencyError, one_line

# JAX and ml_collections are imported inside the functions that need them, so that `--help` and a
# flag error stay fast and a program that takes no `--config` never loads ml_collections.

USAGE_EXIT = 2  # a flag or --config override that does not parse
INPUT_EXIT = 1  # a MicseError: bad config value, corpus, model, checkpoint, data, output


def _not_orbax_chatter(record: logging.LogRecord) -> bool:
  """Orbax warns about its own read-only options on every restore; keep only its errors."""
  return record.levelno >= logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


def quiet_startup() -> None:
  """Hides noise that is not ours: JAX's backend probing INFO line ("Unable to initialize
  backend 'tpu'"), transformers' advice that PyTorch was not found, Orbax's option warnings."""
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  absl_logger = logging.getLogger("absl")
  if _not_orbax_chatter not in absl_logger.filters:
    absl_logger.addFilter(_not_orbax_chatter)


def _jax_plugins() -> list[str]:
  """Names of the installed JAX PJRT plugins (namespace `jax_plugins` and entry points), as JAX
  discovers them; nothing is imported but the namespace package."""
  names = {e.value.rsplit(".", 1)[-1] for e in entry_points(group="jax_plugins")}
  if importlib.util.find_spec("jax_plugins") is not None:
    names |= {m.name for m in pkgutil.iter_modules(importlib.import_module("jax_plugins").__path__)}
  return sorted(names)


def _tpu_library_installed() -> bool:
  """Whether libtpu (the `tpu` extra: TPU VMs, deviceless TPU compiles) is importable."""
  return importlib.util.find_spec("libtpu") is not None


def cpu_when_no_gpu() -> bool:
  """Chooses JAX's CPU platform before JAX initialises when no accelerator is here, whatever of the
  plugins we know is installed: the CUDA plugins without an NVIDIA GPU that JAX itself sees
  (`hardware_utils.has_visible_nvidia_gpu`, the test JAX applies before it would start the CUDA
  backend), libtpu without a TPU chip (JAX's own test, `num_available_tpu_chips_and_device_id`, as
  `cloud_tpu_init`; `JAX_FORCE_TPU_INIT` counts as a TPU). JAX would use the CPU anyway, but the
  CUDA plugin's version check, which fails without a GPU driver, prints a long traceback and
  libtpu warns about the TPU environment it does not find. The JAX docs' way (`JAX_PLATFORMS=cpu`),
  set in-process only; an explicit `JAX_PLATFORMS`, another plugin or an accelerator that is here
  leave JAX's own choice alone. A deviceless compile (`bench --aot`) loads its plugin by itself.
  True when CPU was chosen."""
  if "JAX_PLATFORMS" in os.environ:
    return False
  plugins, tpu_library = _jax_plugins(), _tpu_library_installed()
  if not (plugins or tpu_library) or any(not name.startswith("xla_cuda") for name in plugins):
    return False
  import jax
  try:
    from jax._src import hardware_utils, xla_bridge
    if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
      return False
    if plugins and hardware_utils.has_visible_nvidia_gpu():
      return False
    if tpu_library and ("JAX_FORCE_TPU_INIT" in os.environ
                        or hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0):
      return False
  except (ImportError, AttributeError):  # another jax: keep its own choice (and its output)
    return False
  jax.config.update("jax_platforms", "cpu")
  logging.debug("no GPU or TPU here for the installed plugins: JAX uses the CPU")
  return True


def fail(message: str, status: int = INPUT_EXIT) -> NoReturn:
  """One `error:` line on stderr, then exit with `status`."""
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
  sys.exit(status)


@contextlib.contextmanager
def input_errors_as_one_line() -> Iterator[None]:
  """Turns a `MicseError` (bad user input) into one line and exit 1; anything else propagates."""
  try:
    yield
  except MicseError as e:
    fail(one_line(e))


def flag_error_line(e: BaseException) -> str:
  """The informative line of an absl/ml_collections parsing error (a config file's own
  traceback is reduced to its last line, e.g. `ValueError: unknown config variant ...`)."""
  while e.args and isinstance(e.args[0], BaseException):  # ml_collections wraps a KeyError
    e = e.args[0]
  if isinstance(e, (KeyError, AttributeError)) and e.args and isinstance(e.args[0], str):
    lines = [line.strip() for line in e.args[0].splitlines() if line.strip()]  # 'name', hint
    if lines and lines[0][:1] in "'\"":
      return "; ".join([f"unknown field {lines[0]}"] + lines[1:])
  text = str(e).strip()
  if "Traceback (most recent call last)" in text:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{lines[0].rstrip(':')}: {lines[-1]}"
  return one_line(e) if text else type(e).__name__


def resolve_config_argument(argv: Sequence[str]) -> list[str]:
  """argv with a `--config` value that is no file replaced by the packaged config it names
  (`micse:demo` → `.../micse_jax/configs/micse.py:demo`; `micse_jax.configs.resolve`)."""
  argv = list(argv)
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      argv[i] = "--config=" + configs.resolve(arg[len("--config="):])
    elif arg == "--config" and i + 1 < len(argv):
      argv[i + 1] = configs.resolve(argv[i + 1])
  return argv


HELP_FLAGS = ("help", "?", "helpshort", "helpfull", "helpxml")  # absl's: print the flags, then exit


def _asks_for_help(argv: Sequence[str]) -> bool:
  """Whether the command line holds one of absl's help flags (which exit 1 after printing)."""
  for arg in argv[1:]:
    if arg == "--":
      return False
    if arg.startswith("-") and arg.lstrip("-").split("=", 1)[0] in HELP_FLAGS:
      return True
  return False


def _tuple_overrides_replace(argv: Sequence[str]) -> None:
  """A tuple field's `--config.FIELD` given more than once keeps its last value, as a scalar's does.

  ml_collections defines a tuple field's override as an absl multi-flag whose occurrences are
  concatenated (`--config.population.seeds='(1,2)' --config.population.seeds='(3,)'` would train
  seeds 1, 2 and 3); here every occurrence is one whole value and the last one is parsed again
  on its own (the flag's documented `unparse` and `parse`, which set the config field)."""
  from ml_collections.config_flags import tuple_parser
  given: dict[str, list[str]] = {}
  args = iter(flags.FLAGS.read_flags_from_files(list(argv[1:]), force_gnu=False))
  for arg in args:
    if arg == "--":
      break
    name, has_value, value = arg.lstrip("-").partition("=")
    if not arg.startswith("-") or name not in flags.FLAGS:
      continue
    flag = flags.FLAGS[name]
    if not (has_value or flag.boolean):
      value = next(args, "")  # `--flag VALUE`
    if isinstance(flag.parser, tuple_parser.TupleParser):
      given.setdefault(name, []).append(value)
  for name, values in given.items():
    if len(values) > 1:
      flags.FLAGS[name].unparse()
      flags.FLAGS[name].parse(values[-1])


def _list_configs_and_exit() -> NoReturn:
  print(configs.listing())
  sys.exit(0)


def flags_parser(materialize: Callable[[], object] | None = None):
  """An `app.run(..., flags_parser=)` that reports a bad flag or override as one line (exit 2).

  `materialize` forces lazily-loaded flag values (ml_collections loads a config file on first
  access), so that their errors are reported here and not later, mid-program.
  """
  def parse(argv: Sequence[str]) -> list[str]:
    takes_config = "config" in flags.FLAGS
    if takes_config and "--list_configs" in argv:
      _list_configs_and_exit()
    try:
      argv = resolve_config_argument(argv) if takes_config else list(argv)
      try:
        rest = flags.FLAGS(argv)
      except SystemExit as e:  # absl's help flags print the flags and exit 1: asked for, that is success
        if e.code == 1 and _asks_for_help(argv):
          sys.exit(0)
        raise
      _tuple_overrides_replace(argv)
      if materialize is not None:
        materialize()
    except flags.Error as e:
      fail(flag_error_line(e), USAGE_EXIT)
    except MicseError as e:  # a --config that names no file and no packaged config
      fail(one_line(e), USAGE_EXIT)
    except (AttributeError, KeyError, TypeError, ValueError, OSError, ImportError) as e:
      fail(f"invalid --config: {flag_error_line(e)} (see micse_jax/configs/default.py for the fields)",
           USAGE_EXIT)
    return rest
  return parse


def define_member_flags(verb: str) -> None:
  """`--member` and `--allow_stopped`: which run of a population workdir a command reads, and whether
  a member that stopped (a non-finite update) may be read (`workdir.member_workdir`, `one_run`)."""
  flags.DEFINE_integer("member", None, "For a population workdir: this member (0-based, order of population.seeds).")
  flags.DEFINE_boolean("allow_stopped", False, f"{verb} a population member that stopped (a non-finite update) "
                       "anyway, in its state from before it stopped.")


def reject_extra_args(argv: Sequence[str]) -> None:
  """Positional arguments after the flags are a usage error (one line, exit 2)."""
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])}", USAGE_EXIT)


def missing_packages_as_one_line(main: Callable[[list[str]], object]) -> Callable[[list[str]], object]:
  """`main` with a `MissingDependencyError`, wherever raised, as one `error:` line and exit 1;
  JAX's platform chosen first (`cpu_when_no_gpu`)."""
  @functools.wraps(main)
  def guarded(argv):
    cpu_when_no_gpu()  # after the flags (a usage error stays fast), before JAX starts
    try:
      return main(argv)
    except MissingDependencyError as e:
      fail(one_line(e))
  return guarded


def run_program(main: Callable[[list[str]], object], define_flags: Callable[[], None] | None = None,
                materialize: Callable[[], object] | None = None) -> None:
  """The one skeleton of every program: quiet start-up, flags defined and parsed (a bad flag or
  override: one line, exit 2), then `main(argv)` under absl (a missing optional package: one
  line, exit 1)."""
  quiet_startup()
  if define_flags is not None:
    define_flags()
  app.run(missing_packages_as_one_line(main), flags_parser=flags_parser(materialize))
