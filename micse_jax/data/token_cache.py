"""A text corpus tokenised once per (file content, tokenizer, max length), reused by later runs.

An entry `<cache dir>/<key>.npz` holds the token arrays of every non-blank line of the file, in
file order, and their sentence ids (`corpus.first_occurrence_ids`). The key is a sha256 over the
file's bytes, the tokenizer's fingerprint (`prepared.tokenizer_fingerprint`: vocabulary and
normaliser), the max length and `FORMAT`, so an edited file, another tokenizer or length gets
a new entry and a stale one is never read. Entries are written to a temporary file in the same
folder and renamed into place, so concurrent runs (a sweep) never read a half-written entry;
the last rename wins and both wrote the same arrays. Arrays are stored in the smallest unsigned
dtype that holds them and read back as int32.

Every read is verified: an entry holds the sha256 of its arrays (`DIGEST_KEY`, over names,
dtypes, shapes and bytes), written at store time, and its row counts must agree. An entry that
fails to read for any reason (truncated, cut, a flipped byte: zip, CRC, EOF, digest or shape
errors) is removed with one warning naming it; the caller tokenises again and stores a new one.
Files are created with mode 0666 less the umask, as JAX's cache files are, so a `cache.dir`
shared by a group (umask 002, setgid folder) is writable by all its members.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets

import numpy as np

from micse_jax.data.prepared import tokenizer_fingerprint
from micse_jax.tokenization import TOKEN_KEYS

FORMAT = "micse-tokenized-v2"  # v2: entries carry DIGEST_KEY
IDS_KEY = "sentence_ids"
DIGEST_KEY = "sha256"


def file_digest(path: str) -> str:
  """sha256 of a file's bytes (read in 8 MiB blocks)."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(8 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def cache_key(corpus_path: str, tokenizer, max_length: int) -> str:
  """The entry name of (file content, tokenizer, max length)."""
  payload = f"{FORMAT}\n{file_digest(corpus_path)}\n{tokenizer_fingerprint(tokenizer)}\n{int(max_length)}"
  return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def entry_path(cache_dir: str, key: str) -> str:
  """`<cache_dir>/<key>.npz`."""
  return os.path.join(cache_dir, f"{key}.npz")


def _compact(array: np.ndarray) -> np.ndarray:
  """`array` in the smallest of uint8 / uint16 / int32 that holds its values exactly."""
  if array.size and array.min() >= 0:
    for dtype in (np.uint8, np.uint16):
      if array.max() <= np.iinfo(dtype).max:
        return array.astype(dtype)
  return array.astype(np.int32)


def arrays_digest(arrays: dict[str, np.ndarray]) -> np.ndarray:
  """sha256 (32 uint8) over the name, dtype, shape and bytes of each array, in name order."""
  digest = hashlib.sha256()
  for name in sorted(arrays):
    array = np.ascontiguousarray(arrays[name])
    digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode("utf-8"))
    digest.update(memoryview(array).cast("B"))
  return np.frombuffer(digest.digest(), np.uint8)


def _read_verified(path: str) -> dict[str, np.ndarray]:
  """The stored arrays of an entry; raises when any is missing, damaged or of a wrong length."""
  with np.load(path, allow_pickle=False) as entry:
    arrays = {k: entry[k] for k in (*TOKEN_KEYS, IDS_KEY)}
    stored = entry[DIGEST_KEY]
  if not np.array_equal(stored, arrays_digest(arrays)):
    raise ValueError("checksum mismatch")
  rows = {len(a) for a in arrays.values()}
  if len(rows) != 1 or any(arrays[k].ndim != 2 for k in TOKEN_KEYS):
    raise ValueError(f"inconsistent shapes {[a.shape for a in arrays.values()]}")
  return arrays


def _remove_damaged(path: str, before: os.stat_result, error: BaseException) -> None:
  """Removes a damaged entry (unless another run already replaced it) with one warning line."""
  try:
    now = os.stat(path)
    if (now.st_ino, now.st_size, now.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns):
      os.remove(path)
  except OSError:
    pass  # gone already (another run healed it) or not ours to remove: tokenising again still works
  logging.warning("removed a damaged tokenised-corpus cache entry %s (%s: %s); tokenising again",
                  path, type(error).__name__, " ".join(str(error).split())[:200])


def load(cache_dir: str, key: str) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
  """(token arrays int32 [N, L], sentence ids int32 [N]) of an entry; None when absent, or when
  damaged (then removed, with one warning)."""
  path = entry_path(cache_dir, key)
  try:
    before = os.stat(path)
  except OSError:
    return None
  try:
    arrays = _read_verified(path)
  except Exception as e:  # any failure to read is a damaged entry: zip, CRC, EOF, digest
    _remove_damaged(path, before, e)
    return None
  return {k: arrays[k].astype(np.int32) for k in TOKEN_KEYS}, arrays[IDS_KEY].astype(np.int32)


def _create_temporary(cache_dir: str) -> tuple[int, str]:
  """(fd, path) of a new file in `cache_dir`, mode 0666 less the umask (mkstemp would give 0600)."""
  for _ in range(100):
    path = os.path.join(cache_dir, f".tmp-{os.getpid()}-{secrets.token_hex(8)}.npz")
    try:
      return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), path
    except FileExistsError:
      continue
  raise FileExistsError(f"no free temporary name in {cache_dir}")


def store(cache_dir: str, key: str, tokens: dict[str, np.ndarray], sentence_ids: np.ndarray) -> str:
  """Writes an entry atomically (temporary file in `cache_dir`, then rename), with the digest of
  its arrays; returns its path."""
  os.makedirs(cache_dir, exist_ok=True)
  arrays = {**{k: _compact(np.asarray(tokens[k])) for k in TOKEN_KEYS}, IDS_KEY: _compact(np.asarray(sentence_ids))}
  fd, tmp = _create_temporary(cache_dir)
  try:
    with os.fdopen(fd, "wb") as f:
      np.savez(f, **arrays, **{DIGEST_KEY: arrays_digest(arrays)})
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, entry_path(cache_dir, key))
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return entry_path(cache_dir, key)
