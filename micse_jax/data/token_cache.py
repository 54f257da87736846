"""A text corpus tokenised once per (file content, tokenizer, max length), reused by later runs.

An entry `<cache dir>/<key>.npz` holds the token arrays of every non-blank line of the file, in
file order, and their sentence ids (`corpus.first_occurrence_ids`). The key is a sha256 over the
file's bytes, the tokenizer's fingerprint (`prepared.tokenizer_fingerprint`: vocabulary and
normaliser), the max length and `FORMAT`, so an edited file, another tokenizer or length gets
a new entry and a stale one is never read. Entries are written to a temporary file in the same
folder and renamed into place, so concurrent runs (a sweep) never read a half-written entry;
the last rename wins and both wrote the same arrays. Arrays are stored in the smallest unsigned
dtype that holds them and read back as int32.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile

import numpy as np

from micse_jax.data.prepared import tokenizer_fingerprint
from micse_jax.tokenization import TOKEN_KEYS

FORMAT = "micse-tokenized-v1"
IDS_KEY = "sentence_ids"


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


def load(cache_dir: str, key: str) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
  """(token arrays int32 [N, L], sentence ids int32 [N]) of an entry; None when absent or unreadable."""
  path = entry_path(cache_dir, key)
  if not os.path.isfile(path):
    return None
  try:
    with np.load(path) as entry:
      tokens = {k: entry[k].astype(np.int32) for k in TOKEN_KEYS}
      ids = entry[IDS_KEY].astype(np.int32)
  except (OSError, ValueError, KeyError) as e:
    logging.warning("ignoring unreadable tokenised corpus %s (%s); tokenising again", path, e)
    return None
  return tokens, ids


def store(cache_dir: str, key: str, tokens: dict[str, np.ndarray], sentence_ids: np.ndarray) -> str:
  """Writes an entry atomically (temporary file in `cache_dir`, then rename); returns its path."""
  os.makedirs(cache_dir, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=cache_dir)
  try:
    with os.fdopen(fd, "wb") as f:
      np.savez(f, **{k: _compact(np.asarray(tokens[k])) for k in TOKEN_KEYS},
               **{IDS_KEY: _compact(np.asarray(sentence_ids))})
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, entry_path(cache_dir, key))
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return entry_path(cache_dir, key)
