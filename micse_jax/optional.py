"""Optional dependencies: imported where a path needs them, one error line when one is missing.

The trainer's main path (float32/bfloat16 training on a text corpus, evaluation, export) needs
only the packages of `pyproject.toml`'s `dependencies`. These paths need one more package each;
`require` imports it there and, when it is absent, raises `MissingDependencyError`, which the
command-line programs print as one `error:` line naming the package, the path that needs it and
the pip command (the matching `pyproject.toml` extra in brackets). `require_jax_match` checks
that a jax plugin (the CUDA plugins and PJRT wheels, libtpu) is the version the installed jax
asks for: a mismatch compiles nothing sensible (`IndexError: raw_hash_map<>::at`), so it is one
`VersionMismatchError` line naming both versions.

| import name | distribution | extra | needed by |
| --- | --- | --- | --- |
| `jmp` | jmp | fp16 | float16 dynamic loss scaling (`model.dtype=float16`) |
| `tensorflow_datasets` | tensorflow-datasets | prepared | pre-tokenized corpora (`prepare_data`, a prepared `data.corpus`) |
| `array_record` | array-record | prepared | writing / reading prepared corpora |
| `submitit` | submitit | sweeps | `micse_jax.sweep` (local and SLURM executors) |
| `matplotlib` | matplotlib | plots | sweep figures, `micse_jax.analyze` |
| `torch` | torch | bench | the PyTorch baseline of `micse_jax.bench`, reading `pytorch_model.bin` |
| `sentence_transformers` | sentence-transformers | bench | the encode comparison of `micse_jax.bench --encode` |
| `jax_cuda13_plugin` | jax-cuda13-plugin | aot | `micse_jax.bench --aot h100/h200/a100` (deviceless GPU compile) |
| `jax_cuda12_plugin` | jax-cuda12-plugin | aot-v100 | `micse_jax.bench --aot v100` (CUDA 13 compiles nothing for Volta) |
| `libtpu` | libtpu | tpu | `micse_jax.bench --aot tpu-v4/v5e/v6e` (deviceless TPU compile; on a TPU VM, the runtime) |
"""
from __future__ import annotations

import importlib
import importlib.metadata
import re
import types

from micse_jax.errors import MissingDependencyError, VersionMismatchError

OPTIONAL = {  # import name -> (distribution on PyPI, pyproject extra)
    "jmp": ("jmp", "fp16"),
    "tensorflow_datasets": ("tensorflow-datasets", "prepared"),
    "array_record": ("array-record", "prepared"),
    "submitit": ("submitit", "sweeps"),
    "matplotlib": ("matplotlib", "plots"),
    "torch": ("torch", "bench"),
    "sentence_transformers": ("sentence-transformers", "bench"),
    "jax_cuda13_plugin": ("jax-cuda13-plugin", "aot"),
    "jax_cuda12_plugin": ("jax-cuda12-plugin", "aot-v100"),
    "libtpu": ("libtpu", "tpu"),
}


def require(module: str, purpose: str) -> types.ModuleType:
  """Imports `module` (dotted names allowed) for `purpose`, or raises `MissingDependencyError`."""
  top = module.split(".")[0]
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    if e.name is None or e.name.split(".")[0] != top:
      raise  # the package is there but one of its own imports is broken: keep the traceback
    distribution, extra = OPTIONAL.get(top, (top, None))
    hint = f" (or pip install 'micse-jax[{extra}]')" if extra else ""
    raise MissingDependencyError(
        f"{purpose} needs the package {distribution!r}, which is not installed: "
        f"pip install {distribution}{hint}") from e


def _version(text: str) -> tuple:
  return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0]))


def _satisfies(version: str, specifier: str) -> bool:
  """Whether `version` meets a requirement's comma-separated clauses (`==X`, `==X.*`, `<=X`, `>=X`, `<`, `>`)."""
  for clause in filter(None, (c.strip() for c in specifier.split(","))):
    op, wanted = re.match(r"(==|<=|>=|<|>|!=)\s*(.+)", clause).groups()
    if wanted.endswith(".*"):
      if (op == "==") != (version + ".").startswith(wanted[:-1]):
        return False
      continue
    a, b = _version(version), _version(wanted)
    if not {"==": a == b, "!=": a != b, "<=": a <= b, ">=": a >= b, "<": a < b, ">": a > b}[op]:
      return False
  return True


def jax_pin(distribution: str) -> str:
  """The version specifier the installed jax asks of a plugin distribution: its own extras' pin
  (libtpu, jax-cudaNN-plugin), else (the PJRT wheels) `==` jax's version."""
  for requirement in importlib.metadata.requires("jax") or ():
    match = re.match(r"([A-Za-z0-9_.\-]+)(?:\[[^]]*\])?\s*([^;]*)", requirement)
    if match and match.group(1).lower().replace("_", "-") == distribution and match.group(2).strip():
      return match.group(2).strip()
  return f"=={importlib.metadata.version('jax')}"


def require_jax_match(distribution: str, purpose: str) -> None:
  """Raises `VersionMismatchError` (one line, both versions) when the installed `distribution`
  is not the version the installed jax asks for (`jax_pin`)."""
  installed, jax_version = importlib.metadata.version(distribution), importlib.metadata.version("jax")
  wanted = jax_pin(distribution)
  if not _satisfies(installed, wanted):
    family = distribution.rsplit("-", 1)[0]  # jax-cuda13-pjrt comes with jax-cuda13-plugin
    extra = next((e for d, e in OPTIONAL.values() if d in (distribution, f"{family}-plugin")), "aot")
    raise VersionMismatchError(
        f"{purpose}: {distribution} {installed} is installed beside jax {jax_version}, which needs "
        f"{distribution}{wanted}: pip install '{distribution}{wanted}' (or pip install 'micse-jax[{extra}]', "
        f"which pins a matching set)")
