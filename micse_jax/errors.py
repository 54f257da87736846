"""The project's error types: bad user input, reported by the CLIs as one line.

Every input-validation failure raises a subclass of `MicseError`; the command-line programs
print it as one `error: ...` line and exit non-zero. Any other exception is a bug and keeps
its traceback. The subclasses also derive from `ValueError` so that library callers that
catch `ValueError` keep working.
"""


class MicseError(ValueError):
  """Base class: bad input from the user (config, files, command line)."""


class ConfigError(MicseError):
  """A config field or combination of fields is invalid."""


class CorpusError(MicseError):
  """The corpus file is missing, unreadable, empty, or not UTF-8 text."""


class ModelLoadError(MicseError):
  """A checkpoint could not be turned into parameters."""


class CheckpointError(MicseError):
  """A training workdir or one of its Orbax checkpoints is missing, unreadable or incompatible."""


class SentEvalDataError(MicseError):
  """A SentEval file or directory is missing or malformed."""


class ExportError(MicseError):
  """The parameters or the output location do not allow an export."""


class MissingDependencyError(MicseError):
  """An optional package that the requested path needs is not installed (`micse_jax/optional.py`)."""


class VersionMismatchError(MicseError):
  """An installed plugin of jax (CUDA plugin, PJRT wheel, libtpu) is not the version jax asks for."""


class NonFiniteLossError(MicseError):
  """The loss became NaN/inf; the last saved checkpoint is the last good state."""


def one_line(e: BaseException) -> str:
  """The first line of an exception's message (its type name when the message is empty)."""
  text = str(e).strip()
  return " ".join(text.splitlines()[0].split()) if text else type(e).__name__
