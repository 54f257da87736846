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
"""
from __future__ import annotations

import importlib.util
import logging
import os

import ml_collections

from micse_jax import cache_healing

APP_DIR = "micse_jax"
COMPILATION_DIR = "jax_compilation_cache"
TOKENIZED_DIR = "tokenized"
DEFAULT_COMPILATION_MAX_SIZE = 16 * 2**30  # bytes kept by JAX's LRU eviction
JAX_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable: used when `cache.dir` is unset

_applied: tuple | None = None  # (folder, max size) this process last pointed JAX's cache at


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
  """Where tokenised corpora are kept; None when `cache.tokenized` is off."""
  return os.path.join(cache_root(config), TOKENIZED_DIR) if _enabled(config, "tokenized") else None


def enable_compilation_cache(config: ml_collections.ConfigDict) -> str | None:
  """Points JAX's persistent compilation cache at `compilation_cache_dir(config)` (or turns it
  off) before the run's first compile; every program is cached, however fast it compiled or
  small it is (JAX's defaults skip compiles under 1 s, i.e. most CPU programs); its reads are
  verified and heal (`cache_healing.install`). Returns the dir."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache as jax_cache
  directory = compilation_cache_dir(config)
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
