"""The user's caches: JAX's persistent compilation cache and tokenised corpora, paid for once.

Both live under one root, `cache.dir` when set, else `$XDG_CACHE_HOME/micse_jax` (else
`~/.cache/micse_jax`):

    <root>/jax_compilation_cache/   JAX's own persistent cache (`jax_compilation_cache_dir`)
    <root>/tokenized/<sha256>.npz   a text corpus tokenised once (`micse_jax.data.token_cache`)

Every run of a sweep and every resume points at the same root, so a program compiled or a corpus
tokenised by one run is read by the next. `cache.compilation=False` / `cache.tokenized=False`
turn either off; with `cache.dir` unset, a `JAX_COMPILATION_CACHE_DIR` set by hand is kept.

JAX keys each entry by the program, the jaxlib version, the backend's platform and version, the
devices and the XLA flags, so entries of another jax or device are never read. With
`cache.compilation_max_size` set (bytes; -1: unbounded), JAX's LRU eviction is on and every read
and write holds a `filelock` on the cache folder, so concurrent runs of a sweep never read a
half-written entry. Every read is verified and heals (`micse_jax/cache_healing.py`): a damaged
entry (truncated, cut, a flipped byte) is removed with one warning, compiled again and stored
again, so the next run is warm; a tokenised corpus likewise (`micse_jax/data/token_cache.py`).
Files are created with mode 0666 less the umask (JAX's and ours), so a folder shared by a group
works for every member with umask 002 (and a setgid folder keeps the group).

A cache folder that cannot be written (read-only, or a file where it or a folder above it should
be) is found before the run uses it (`unusable_reason`: a file written and removed in it, JAX's
lock file opened): the run goes on without that cache, and says so in one line (what, where, what
to do; `unusable_notes`) instead of a warning from JAX per program. One that fails later, mid-run,
is one line too (`cache_healing`).

Entries survive a move of the cache folder: JAX would name the folder inside every key (it points
XLA's per-fusion GPU autotuning cache, `jax_persistent_cache_enable_xla_caches`, at a folder in it,
and hashes that path with the compile options), so a moved or renamed cache would miss everything
once. That XLA cache is turned off (`RELOCATABLE_XLA_CACHES`): a whole program's entry holds its
autotuned kernels already; only a program never compiled before loses XLA's reuse of autotuning
results for fusions it shares with another.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import tempfile

import ml_collections

from micse_jax import cache_healing

APP_DIR = "micse_jax"
COMPILATION_DIR = "jax_compilation_cache"
TOKENIZED_DIR = "tokenized"
DEFAULT_COMPILATION_MAX_SIZE = 16 * 2**30  # bytes kept by JAX's LRU eviction
JAX_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable: used when `cache.dir` is unset

RELOCATABLE_XLA_CACHES = "none"  # `jax_persistent_cache_enable_xla_caches`: no folder path in any key
LOCK_FILE = ".lockfile"  # JAX's `filelock` in the compilation cache folder (with LRU eviction)
CACHE_NAMES = {COMPILATION_DIR: "compilation cache (compiled programs)", TOKENIZED_DIR: "tokenised-corpus cache"}

_applied: tuple | None = None  # (folder, max size) this process last pointed JAX's cache at
_unusable: dict[str, str] = {}  # this run's cache folders that cannot be written -> why (`check_folders`)


def user_cache_root() -> str:
  """`$XDG_CACHE_HOME/micse_jax`, else `~/.cache/micse_jax` (not created here)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, APP_DIR)


def _cache_config(config: ml_collections.ConfigDict):
  """The config's `cache` group; None for a config written before it existed (defaults apply)."""
  return config.get("cache") if hasattr(config, "get") else None


def cache_root(config: ml_collections.ConfigDict) -> str:
  """`cache.dir` (user-expanded, absolute) when set, else `user_cache_root()`."""
  group = _cache_config(config)
  directory = group.get("dir", "") if group is not None else ""
  return os.path.abspath(os.path.expanduser(directory)) if directory else user_cache_root()


def _enabled(config: ml_collections.ConfigDict, field: str) -> bool:
  group = _cache_config(config)
  return bool(group.get(field, True)) if group is not None else True


def compilation_cache_dir(config: ml_collections.ConfigDict) -> str | None:
  """Where JAX's persistent compilation cache lives; None when `cache.compilation` is off.

  `<cache root>/jax_compilation_cache`; with `cache.dir` unset, JAX's own variable
  `JAX_COMPILATION_CACHE_DIR` (set by hand) is honoured."""
  if not _enabled(config, "compilation"):
    return None
  group = _cache_config(config)
  if not (group is not None and group.get("dir", "")) and os.environ.get(JAX_DIR_ENV):
    return os.path.abspath(os.path.expanduser(os.environ[JAX_DIR_ENV]))
  return os.path.join(cache_root(config), COMPILATION_DIR)


def tokenized_cache_dir(config: ml_collections.ConfigDict) -> str | None:
  """Where tokenised corpora are kept; None when `cache.tokenized` is off or its folder cannot be
  written (found by `enable_compilation_cache` at the run's start)."""
  folder = _tokenized_folder(config)
  return None if folder in _unusable else folder


def _tokenized_folder(config: ml_collections.ConfigDict) -> str | None:
  return os.path.join(cache_root(config), TOKENIZED_DIR) if _enabled(config, "tokenized") else None


def unusable_reason(folder: str) -> str | None:
  """Why `folder` cannot hold cache entries, None when it can: it (or a folder above it) is a file,
  or it cannot be created, or a file cannot be written in it, or JAX's lock file there cannot be
  opened for writing. A missing folder is created, as the caches would."""
  existing = folder
  while not os.path.exists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"{existing} is a file, not a folder"
  steps = (("creating the folder", lambda: os.makedirs(folder, exist_ok=True)),
           ("creating a file there", lambda: _write_and_remove(folder)),
           (f"opening its {LOCK_FILE}", lambda: _open_lock(folder)))  # JAX locks every read and write
  for doing, step in steps:
    try:
      step()
    except OSError as e:
      return f"{e.strerror or type(e).__name__} when {doing}"
  return None


def _write_and_remove(folder: str) -> None:
  handle, probe = tempfile.mkstemp(prefix=".micse-probe-", dir=folder)
  os.close(handle)
  os.remove(probe)


def _open_lock(folder: str) -> None:
  lock = os.path.join(folder, LOCK_FILE)
  if os.path.exists(lock):
    open(lock, "a").close()


def check_folders(config: ml_collections.ConfigDict) -> dict[str, str]:
  """{folder: why} of the config's enabled cache folders that cannot be written; remembered for this
  run (the compilation cache is then off, `tokenized_cache_dir` None), for `unusable_notes`."""
  _unusable.clear()
  for folder in (compilation_cache_dir(config), _tokenized_folder(config)):
    reason = unusable_reason(folder) if folder and "://" not in folder else None
    if reason:
      _unusable[folder] = reason
  return dict(_unusable)


def unusable_line(unusable: dict[str, str]) -> str:
  """The one line that says which cache folders this run goes on without, why, and what to do."""
  by_reason: dict[str, list[str]] = {}
  for folder, reason in unusable.items():
    by_reason.setdefault(reason, []).append(f"the {CACHE_NAMES.get(os.path.basename(folder), 'cache')} {folder}")
  what = "; ".join(f"{' and '.join(folders)} cannot be written ({reason})" for reason, folders in by_reason.items())
  return (f"{what}: {cache_healing.go_on_without('it' if len(unusable) == 1 else 'them')} "
          "(--config.cache.compilation=False / --config.cache.tokenized=False turn a cache off)")


def unusable_notes() -> list[str]:
  """`unusable_line` of this run's cache folders that cannot be written (`check_folders`), or no line."""
  return [unusable_line(_unusable)] if _unusable else []


def open_for_run(config: ml_collections.ConfigDict) -> tuple[str | None, list[str]]:
  """A run's caches opened before its first compile: JAX's compilation cache enabled
  (`enable_compilation_cache`, its folder returned) and the lines to say once the run's input is
  checked (`unusable_notes`: one, where a cache folder cannot be written)."""
  return enable_compilation_cache(config), unusable_notes()


def enable_compilation_cache(config: ml_collections.ConfigDict) -> str | None:
  """Points JAX's persistent compilation cache at `compilation_cache_dir(config)` (or turns it
  off) before the run's first compile; every program is cached, however fast it compiled or
  small it is (JAX's defaults skip compiles under 1 s, i.e. most CPU programs); its reads are
  verified and heal (`cache_healing.install`); its keys name no folder (`RELOCATABLE_XLA_CACHES`).
  A cache folder that cannot be written is left out of this run (`check_folders`; the trainer
  says it once its input is checked, `unusable_notes`). Returns the dir."""
  import jax  # here, not at the top: the config checks read this module's folders without JAX
  from jax.experimental.compilation_cache import compilation_cache as jax_cache
  unusable = check_folders(config)
  directory = compilation_cache_dir(config)
  directory = None if directory in unusable else directory
  group = _cache_config(config)
  max_size = group.get("compilation_max_size", DEFAULT_COMPILATION_MAX_SIZE) if group is not None \
      else DEFAULT_COMPILATION_MAX_SIZE
  if max_size != -1 and importlib.util.find_spec("filelock") is None:
    logging.warning("the filelock package is missing: JAX's compilation cache runs unbounded and "
                    "without its lock (pip install filelock)")
    max_size = -1  # JAX refuses a bounded cache without filelock
  global _applied
  cache_healing.install()  # before JAX opens the folder: reads verified, damaged entries healed
  if _applied is not None and _applied != (directory, max_size):
    jax_cache.reset_cache()  # JAX opens its cache once per process: a later run may name another folder
  _applied = (directory, max_size)
  jax.config.update("jax_enable_compilation_cache", directory is not None)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  jax.config.update("jax_compilation_cache_max_size", max_size)
  jax.config.update("jax_persistent_cache_enable_xla_caches", RELOCATABLE_XLA_CACHES)
  logging.debug("JAX compilation cache: %s", directory or "off")
  return directory


def check_cache_dir(value) -> str | None:
  """`cache.dir`: a string; "" means the user's cache folder (the `RULES` check)."""
  return None if isinstance(value, str) else f"must be a string ('' = $XDG_CACHE_HOME/micse_jax), got {value!r}"


def check_max_size(value) -> str | None:
  """`cache.compilation_max_size`: bytes >= 1, or -1 for an unbounded cache without JAX's lock."""
  if isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value >= 1):
    return None
  return f"must be -1 (unbounded) or a positive number of bytes, got {value!r}"
