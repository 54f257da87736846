"""Reading an unlabelled training corpus (one sentence per line) and few-shot subsets.

Every problem with the input file is reported as a `CorpusError` whose message is one
line naming the file, so that a bad `--corpus` flag fails before any model is built.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from micse_jax.errors import CorpusError  # re-exported

_BOM = "\ufeff"


def _read_bytes(path: str) -> bytes:
  """Returns the raw bytes of `path`, translating OS errors into `CorpusError`."""
  if os.path.isdir(path):
    raise CorpusError(f"corpus path is a directory, expected a text file: {path}")
  if not os.path.exists(path):
    raise CorpusError(f"corpus file not found: {path}")
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError as e:
    raise CorpusError(f"cannot read corpus file {path}: {e.strerror or e}") from e


def _decode_utf8(data: bytes, path: str) -> str:
  """Decodes `data` as UTF-8; on failure names the line number and byte offset."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    bad = data[e.start:e.end].hex()
    raise CorpusError(
        f"corpus file is not valid UTF-8: {path}: line {line}, byte offset {e.start}"
        f" (bytes 0x{bad}: {e.reason})") from e


def read_corpus(path: str) -> list[str]:
  """Reads one sentence per line, dropping line endings and blank lines.

  Lines are split on "\\n" only (a trailing "\\r" is removed), so characters such as
  form feeds or U+2028 inside a sentence do not split it. Text within a line is kept
  as is. A leading UTF-8 byte-order mark is dropped.

  Args:
    path: a UTF-8 text file.

  Returns:
    The non-blank lines, in file order.

  Raises:
    CorpusError: the path is missing or a directory, the file cannot be read, is
      empty, has only blank lines, or is not valid UTF-8.
  """
  path = os.fspath(path)
  data = _read_bytes(path)
  if not data:
    raise CorpusError(f"corpus file is empty: {path}")
  text = _decode_utf8(data, path)
  if text.startswith(_BOM):
    text = text[len(_BOM):]
  lines = (line[:-1] if line.endswith("\r") else line for line in text.split("\n"))
  sentences = [line for line in lines if line.strip()]
  if not sentences:
    raise CorpusError(f"corpus file has only blank lines: {path}")
  return sentences


def first_occurrence_ids(sentences: Sequence[str]) -> np.ndarray:
  """Sentence ids: each index mapped to the index of its text's first occurrence.

  Exact duplicates (same text at different lines) get the same id, so a loss that compares
  ids (the same-sentence mask of the momentum queue) treats them as one sentence.

  Args:
    sentences: the corpus as returned by `read_corpus`.

  Returns:
    int32 array `[len(sentences)]`; `ids[i] <= i`, and `ids[i] == i` for a first occurrence.
  """
  first: dict[str, int] = {}
  return np.fromiter((first.setdefault(s, i) for i, s in enumerate(sentences)),
                     dtype=np.int32, count=len(sentences))


def subset_indices(total: int, num_sentences: int | None, seed: int) -> np.ndarray:
  """Indices of a seeded few-shot subset of `range(total)`.

  The indices are the first `num_sentences` entries of a permutation drawn with
  `seed`, so for a fixed seed a smaller subset is a prefix of a larger one.

  Args:
    total: size of the full corpus.
    num_sentences: subset size; `None` or <= 0 selects everything, in corpus order.
    seed: non-negative integer seed of the permutation.

  Returns:
    int64 array of corpus indices.

  Raises:
    CorpusError: `num_sentences` exceeds `total`.
  """
  if num_sentences is None or num_sentences <= 0:
    return np.arange(total, dtype=np.int64)
  if num_sentences > total:
    raise CorpusError(
        f"requested a subset of {num_sentences} sentences but the corpus has only {total}")
  permutation = np.random.default_rng(seed).permutation(total)
  return permutation[:num_sentences].astype(np.int64)


def select_subset(sentences: Sequence[str], num_sentences: int | None, seed: int) -> list[str]:
  """A fixed random subset of `num_sentences` sentences for few-shot training.

  For a fixed seed (and corpus) subsets are nested: `select_subset(s, m, seed)[:n] ==
  select_subset(s, n, seed)` for n <= m.

  Args:
    sentences: the full corpus.
    num_sentences: subset size; `None` or <= 0 keeps all sentences in corpus order.
    seed: non-negative integer seed.

  Returns:
    The selected sentences, in the order of the seeded permutation.

  Raises:
    CorpusError: `num_sentences` exceeds the number of sentences.
  """
  indices = subset_indices(len(sentences), num_sentences, seed)
  return [sentences[i] for i in indices]
