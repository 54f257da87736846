"""Optional dependencies: imported where a path needs them, one error line when one is missing.

The trainer's main path (float32/bfloat16 training on a text corpus, evaluation, export) needs
only the packages of `pyproject.toml`'s `dependencies`. These paths need one more package each;
`require` imports it there and, when it is absent, raises `MissingDependencyError`, which the
command-line programs print as one `error:` line naming the package, the path that needs it and
the pip command (the matching `pyproject.toml` extra in brackets).

| import name | distribution | extra | needed by |
| --- | --- | --- | --- |
| `jmp` | jmp | fp16 | float16 dynamic loss scaling (`model.dtype=float16`) |
| `tensorflow_datasets` | tensorflow-datasets | prepared | pre-tokenized corpora (`prepare_data`, a prepared `data.corpus`) |
| `array_record` | array-record | prepared | writing / reading prepared corpora |
| `submitit` | submitit | sweeps | `micse_jax.sweep` (local and SLURM executors) |
| `matplotlib` | matplotlib | plots | sweep figures, `micse_jax.analyze` |
| `torch` | torch | bench | the PyTorch baseline of `micse_jax.bench`, reading `pytorch_model.bin` |
| `sentence_transformers` | sentence-transformers | bench | the encode comparison of `micse_jax.bench --encode` |
| `jax_cuda13_plugin` | jax-cuda13-plugin | aot | `micse_jax.bench --aot h100/a100/v100` (deviceless GPU compile) |
| `libtpu` | libtpu | tpu | `micse_jax.bench --aot tpu-v4/v5e/v6e` (deviceless TPU compile; on a TPU VM, the runtime) |
"""
from __future__ import annotations

import importlib
import types

from micse_jax.errors import MissingDependencyError

OPTIONAL = {  # import name -> (distribution on PyPI, pyproject extra)
    "jmp": ("jmp", "fp16"),
    "tensorflow_datasets": ("tensorflow-datasets", "prepared"),
    "array_record": ("array-record", "prepared"),
    "submitit": ("submitit", "sweeps"),
    "matplotlib": ("matplotlib", "plots"),
    "torch": ("torch", "bench"),
    "sentence_transformers": ("sentence-transformers", "bench"),
    "jax_cuda13_plugin": ("jax-cuda13-plugin", "aot"),
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
