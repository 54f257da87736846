"""JAX's persistent compilation cache with verified reads that heal a damaged entry.

JAX (0.10.2) writes an entry in place and never overwrites an existing one, and a read that
fails (a truncated file: the decompressor raises) only warns and compiles again, so one damaged
entry costs a full compile in every later run. `install()` wraps two functions of
`jax._src.compilation_cache`, guarded (a jax without them keeps its own behaviour, no healing):

- `get_file_cache`: the file cache it returns is wrapped in a `VerifiedCache`, which stores each
  value behind `MAGIC` and its sha256 and checks that digest on every read; a mismatch (a cut or
  a flipped byte that a decompressor without a checksum, zstd's default, would pass on to the
  executable loader) is a damaged entry. Values are written atomically (temporary file, rename)
  when JAX's cache runs without its lock; with the lock (LRU eviction on), JAX's own write is
  used under it, and a write torn by a kill fails the digest. Entries without `MAGIC` (written by
  plain JAX into a shared folder) are returned as they are.
- `get_executable_and_time`: an entry that fails to decompress or deserialise is damaged too.

A damaged entry is removed (with its LRU access-time file) unless another process replaced it
since it was read, with one warning line naming it; JAX then compiles the program and stores
it again, so the next run is warm. `jax_raise_persistent_cache_errors` still raises.

A cache folder that stops working mid-run (made read-only, a lock file not ours to write, a folder
that cannot be created: an `OSError` from the file cache) is one warning line for the run, which
goes on without the cache, instead of JAX's warning per program read and per program written.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import secrets

# JAX is imported inside the functions: this module sits below the config checks (`caches`), which
# must not start JAX, and its `jax._src` modules are private (guarded: another jax may lack them).
MAGIC = b"micse-sha256\n"
DIGEST_BYTES = 32
_MARK = "_micse_healing"  # set on the wrappers, so `install()` wraps once


def _suffix(name: str, default: str) -> str:
  try:
    from jax._src import lru_cache
  except ImportError:
    return default
  return getattr(lru_cache, name, default)


def seal(value: bytes) -> bytes:
  """`MAGIC` + sha256(value) + value: what is written for `value`."""
  return MAGIC + hashlib.sha256(value).digest() + value


def unseal(blob: bytes) -> bytes | None:
  """The value of a sealed blob; `blob` itself when it is not sealed; None when its digest fails."""
  if not blob.startswith(MAGIC):
    return blob
  digest, value = blob[len(MAGIC):len(MAGIC) + DIGEST_BYTES], blob[len(MAGIC) + DIGEST_BYTES:]
  return value if hashlib.sha256(value).digest() == digest else None


def _stat_key(path: str | None):
  try:
    found = os.stat(path) if path else None
  except OSError:
    return None
  return None if found is None else (found.st_ino, found.st_size, found.st_mtime_ns)


class VerifiedCache:
  """A JAX file cache (`LRUCache`) whose values carry their sha256 and heal when damaged."""

  def __init__(self, base):
    self._base = base
    self._read_stats: dict[str, tuple] = {}  # key -> the entry file's (inode, size, mtime) when read
    self.failed = False  # the folder failed once: the rest of the run goes on without it

  @property
  def _path(self):
    return self._base._path

  @_path.setter
  def _path(self, value):
    self._base._path = value

  def __getattr__(self, name):  # eviction_enabled, lock, path, ...: the base cache's
    return getattr(self._base, name)

  @property
  def folder(self) -> str:
    """The cache's folder (a local path or a remote URL)."""
    return str(getattr(self._base, "path", None) or self._base._path)

  def entry_file(self, key: str) -> str | None:
    """The local file of `key`'s entry; None for a remote cache folder."""
    folder = self.folder
    return None if "://" in folder else os.path.join(folder, key + _suffix("_CACHE_SUFFIX", "-cache"))

  def get(self, key: str) -> bytes | None:
    """The verified value of `key`; None when absent or damaged (then healed), or when the folder
    cannot be used (`give_up`)."""
    if self.failed:
      return None
    stat = _stat_key(self.entry_file(key))
    if stat is not None:
      self._read_stats[key] = stat
    try:
      blob = self._base.get(key)
    except FileNotFoundError:  # removed since (eviction, another run's healing): a miss
      return None
    except OSError as e:
      return self.give_up(e)
    if blob is None:
      return None
    value = unseal(blob)
    if value is None:
      self.heal(key, "checksum mismatch")
    return value

  def put(self, key: str, value: bytes) -> None:
    """Stores `value` sealed; atomically where JAX would write in place without its lock."""
    if self.failed:
      return
    blob = seal(value)
    path = self.entry_file(key)
    try:
      if path is None or getattr(self._base, "eviction_enabled", True) is not False:
        self._base.put(key, blob)
      elif not os.path.exists(path):  # as JAX: an existing entry is kept
        _write_atomically(path, blob)
    except OSError as e:
      self.give_up(e)

  def give_up(self, error: OSError) -> None:
    """The rest of the run goes on without this cache folder, said in one line (not JAX's warning
    per program)."""
    self.failed = True
    logging.warning(failed_line(self.folder, error))

  def clear(self):
    """The base cache's `clear`, where it has one."""
    return self._base.clear() if hasattr(self._base, "clear") else None

  def heal(self, key: str, reason: str) -> bool:
    """Removes `key`'s entry (and access-time file) if it is still the file that was read, with
    one warning; False when there was nothing of ours to remove."""
    path, read = self.entry_file(key), self._read_stats.pop(key, None)
    if path is None or read is None:
      return False
    lock = getattr(self._base, "lock", None) if getattr(self._base, "eviction_enabled", False) else None
    try:
      with lock.acquire(timeout=getattr(self._base, "lock_timeout_secs", 10)) if lock else contextlib.nullcontext():
        if _stat_key(path) != read:
          return False  # replaced by another process since it was read
        os.remove(path)
        atime = path[:-len(_suffix("_CACHE_SUFFIX", "-cache"))] + _suffix("_ATIME_SUFFIX", "-atime")
        with contextlib.suppress(FileNotFoundError):
          os.remove(atime)
    except Exception:  # a lock timeout, a folder not ours to write: JAX compiles again all the same
      return False
    logging.warning("removed a damaged JAX compilation-cache entry %s (%s); compiling again", path,
                    " ".join(reason.split())[:200])
    return True


def go_on_without(what: str) -> str:
  """The end of every line that says a run goes on without a cache folder: what happens, what to do."""
  return (f"this run goes on without {what} (nothing cached, nothing read); make it a writable folder, or point "
          "--config.cache.dir at one")


def failed_line(folder: str, error: OSError) -> str:
  """The one line for a compilation-cache folder that cannot be used from some point of a run on."""
  reason = f"{error.strerror or type(error).__name__}: {error.filename or folder}"
  return (f"the compilation cache {folder} cannot be used ({reason}): {go_on_without('it')} "
          "(--config.cache.compilation=False turns it off)")


def _write_atomically(path: str, blob: bytes) -> None:
  """`blob` into `path` through a temporary file beside it (mode 0666 less the umask), then rename."""
  tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
  try:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as f:
      f.write(blob)
    os.replace(tmp, path)
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)


def _verified(cache) -> VerifiedCache | None:
  """The `VerifiedCache` in JAX's cache object (itself, or under JAX's `VerificationCache`)."""
  while cache is not None and not isinstance(cache, VerifiedCache):
    cache = getattr(cache, "_base_cache", None)
  return cache


def _wrap_file_cache(original):
  @functools.wraps(original)
  def get_file_cache(path, *args, **kwargs):
    try:
      made = original(path, *args, **kwargs)
    except OSError as e:  # the folder cannot be created: no cache this run, one line (JAX would warn per program)
      logging.warning(failed_line(str(path), e))
      return None
    if made is None:
      return None
    cache, rest = (made[0], made[1:]) if isinstance(made, tuple) else (made, None)
    if hasattr(cache, "_base_cache"):  # jax_compilation_cache_check_contents: verify beneath it
      cache._base_cache = VerifiedCache(cache._base_cache)
    else:
      cache = VerifiedCache(cache)
    return cache if rest is None else (cache, *rest)
  setattr(get_file_cache, _MARK, True)
  return get_file_cache


def _wrap_read(original, module):
  @functools.wraps(original)
  def get_executable_and_time(cache_key, *args, **kwargs):
    try:
      return original(cache_key, *args, **kwargs)
    except Exception as e:
      import jax
      verified = _verified(getattr(module, "_cache", None))
      if getattr(jax.config, "jax_raise_persistent_cache_errors", False) or verified is None \
          or not verified.heal(cache_key, f"{type(e).__name__}: {e}"):
        raise  # JAX warns and compiles again, as without healing
      return None, None
  setattr(get_executable_and_time, _MARK, True)
  return get_executable_and_time


def install() -> bool:
  """Wraps JAX's cache factory and read (once per process); True when healing is on. Call it
  before the cache is first used: a cache JAX already opened without it is reset."""
  try:
    from jax._src import compilation_cache as module
  except ImportError:
    return False
  factory, read = getattr(module, "get_file_cache", None), getattr(module, "get_executable_and_time", None)
  if not (callable(factory) and callable(read)):
    logging.debug("this jax has no get_file_cache/get_executable_and_time: compilation cache not healed")
    return False
  if not getattr(factory, _MARK, False):
    module.get_file_cache = _wrap_file_cache(factory)
  if not getattr(read, _MARK, False):
    module.get_executable_and_time = _wrap_read(read, module)
  if getattr(module, "_cache", None) is not None and _verified(module._cache) is None:
    module.reset_cache()  # opened before install: reopened through the wrapper on next use
  return True
