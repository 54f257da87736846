"""Deterministic, random-access, host-sharded training batches for unsupervised SimCSE.

The corpus is tokenized once, padded to a fixed `max_length` (static shapes, so the
jitted train step compiles once), into int32 arrays `[N, max_length]` (or read on demand
from a prepared corpus, `micse_jax.data.prepared`). Batches are a pure function of the
step number: resuming from a checkpoint at step `s` only needs `s`, and yields exactly the
batches of an uninterrupted run.

The shuffle (`SHUFFLE_SCHEME`, recorded as `data.shuffle` in a run's config.json):

* Every epoch e is a fresh permutation of the corpus, drawn once and vectorised,
  `numpy.random.Generator(PCG64(SeedSequence([base_seed, e]))).permutation(N)`, where
  `base_seed` is a hash (`np.random.SeedSequence`) of the user seed, so runs with seeds s and
  s + 1 do not share shifted epoch orders. Step s of the epoch takes entries
  `[s * B, (s + 1) * B)` of it; the permutation is cached, so a step costs a slice.
* Epoch boundaries: the last `N % B` sentences of each epoch's permutation are dropped (a
  different set every epoch); batches never wrap across epochs, so no global batch holds the
  same sentence twice (it would be its own in-batch negative). `steps_per_epoch = N // B`,
  `epoch_of(step) = step // steps_per_epoch`.
* Host sharding: host i reads only its rows `[i * P/h, (i + 1) * P/h)` of the (padded) global
  batch, so concatenating the hosts' batches in process order gives the global batch.
* Padding (`padded_batch_size` P >= B, for a batch that devices do not divide): positions
  >= B of the global batch are padding rows, a copy of the global batch's first row with
  `sentence_ids` -1 and `row_mask` 0; real rows are those of the unpadded run.
* Sentence ids: besides the token arrays each batch carries `sentence_ids` `[rows]` int32, the
  corpus index of each row's sentence (duplicate texts share their first occurrence's index;
  see `corpus.first_occurrence_ids`), global corpus ids, not positions in the few-shot subset,
  so every host agrees on them (the momentum queue masks an anchor's own sentence by them), and `row_mask`.

Runs of earlier releases used grain's `MapDataset.shuffle` (a Feistel index shuffle); that
order is not reproduced, and such workdirs (no `data.shuffle` in config.json) are refused on
resume (`resume_checks.check_resume_compatible`).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Iterator, Mapping, Sequence

import jax
import numpy as np
from tqdm import tqdm

from micse_jax.data import token_cache
from micse_jax.data.corpus import CorpusError, first_occurrence_ids, read_corpus, subset_indices
from micse_jax.tokenization import TOKEN_KEYS, Tokenizer

SENTENCE_IDS_KEY = "sentence_ids"
ROW_MASK_KEY = "row_mask"
SHUFFLE_SCHEME = "numpy-pcg64-epoch-permutation"  # config data.shuffle; see module docstring
SHUFFLE_SCHEMES = (SHUFFLE_SCHEME,)  # the schemes `data.shuffle` may name (config_checks reads this)
PADDING_SENTENCE_ID = -1
DEFAULT_MAX_LENGTH = 32


def tokenize_corpus(sentences: Sequence[str], tokenizer: Tokenizer, max_length: int = DEFAULT_MAX_LENGTH,
                    chunk_size: int = 8192, show_progress: bool = True) -> dict[str, np.ndarray]:
  """Tokenizes all sentences once, right-padded (and truncated) to `max_length`.

  Args:
    sentences: the corpus.
    tokenizer: a `micse_jax.tokenization.Tokenizer`.
    max_length: fixed sequence length, including special tokens.
    chunk_size: sentences per call of the HF tokenizer.
    show_progress: show a tqdm progress bar.

  Returns:
    The token-batch dict of int32 arrays `[len(sentences), max_length]`.
  """
  if max_length <= 0:
    raise ValueError(f"max_length must be positive, got {max_length}")
  n = len(sentences)
  out = {k: np.empty((n, max_length), dtype=np.int32) for k in TOKEN_KEYS}
  with tqdm(total=n, desc="tokenizing", unit="sent", disable=not show_progress) as bar:
    for start in range(0, n, chunk_size):
      chunk = sentences[start:start + chunk_size]
      enc = tokenizer(chunk, max_length, pad_to=max_length)
      for k in TOKEN_KEYS:
        out[k][start:start + len(chunk)] = enc[k]
      bar.update(len(chunk))
  return out


def _derive_seed(seed: int) -> int:
  """A well-mixed 32-bit shuffle seed from a non-negative user seed."""
  if seed < 0:
    raise ValueError(f"seed must be non-negative, got {seed}")
  return int(np.random.SeedSequence(int(seed)).generate_state(1, dtype=np.uint32)[0])


def _validate_tokens(tokens: Mapping[str, np.ndarray]) -> int:
  """Checks the token dict has the three `[N, L]` arrays; returns N."""
  missing = [k for k in TOKEN_KEYS if k not in tokens]
  if missing:
    raise ValueError(f"tokens is missing keys {missing}; expected {list(TOKEN_KEYS)}")
  shapes = {k: np.shape(tokens[k]) for k in TOKEN_KEYS}
  first = shapes[TOKEN_KEYS[0]]
  if len(first) != 2 or any(s != first for s in shapes.values()):
    raise ValueError(f"token arrays must all have the same shape [N, length], got {shapes}")
  return first[0]


def epoch_permutation(base_seed: int, epoch: int, num_sentences: int) -> np.ndarray:
  """Epoch `epoch`'s order of the corpus: a PCG64 permutation seeded by `(base_seed, epoch)`.

  int32 when the corpus allows it (half the memory of int64); drawn in one vectorised call.
  """
  rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(base_seed), int(epoch)])))
  permutation = rng.permutation(num_sentences)
  return permutation.astype(np.int32) if num_sentences < 2**31 else permutation


def batch_layout(max_length: int):
  """The `data/packing.BatchLayout` of every `TrainBatches.batch`: the token arrays `[rows,
  max_length]`, `sentence_ids` and `row_mask` `[rows]` (the compiled step's batch, known without data)."""
  from micse_jax.data.packing import BatchLayout
  keys = (*TOKEN_KEYS, SENTENCE_IDS_KEY, ROW_MASK_KEY)
  return BatchLayout.of({k: np.zeros((1, max_length) if k in TOKEN_KEYS else (1,), np.int32) for k in keys})


class TrainBatches:
  """Infinite, step-indexed training batches; `batch(step)` is a pure function of step.

  See the module docstring for the shuffle / epoch / sharding / padding semantics. Thread-safe
  (a prefetch thread may call `batch` while the main thread calls `global_sentence_ids`).
  """

  def __init__(self, tokens, global_batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1, sentence_ids: np.ndarray | None = None,
               padded_batch_size: int | None = None):
    """Checks the layout; the epoch permutations are drawn lazily (one per epoch, cached).

    Args:
      tokens: dict of int32 arrays `[N, length]` (`TOKEN_KEYS`), or a random-access row
        source with `len()` and `gather(indices) -> token dict` (a prepared corpus,
        `micse_jax.data.prepared`), which is read only at the rows of this host's batches.
      global_batch_size: real sentences per step summed over all hosts (B).
      seed: non-negative shuffle seed.
      process_index: this host's index in `[0, process_count)`.
      process_count: number of hosts; must divide the padded batch size.
      sentence_ids: int `[N]` corpus id of each row (default `arange(N)`), batched as
        `sentence_ids`.
      padded_batch_size: rows per step over all hosts including padding rows (P >= B,
        default B); `training.data_parallel.padded_batch_size` makes it a multiple of the device count.

    Raises:
      ValueError: inconsistent arguments or fewer than `global_batch_size` sentences.
    """
    if isinstance(tokens, Mapping):
      self._num_sentences = _validate_tokens(tokens)
      self.tokens = {k: np.asarray(tokens[k], dtype=np.int32) for k in TOKEN_KEYS}
      self._rows = None
      self.sentence_ids = self._check_ids(sentence_ids)
    else:  # a row source (prepared corpus): token rows and sentence ids are read on demand
      self._num_sentences, self.tokens, self._rows, self.sentence_ids = len(tokens), None, tokens, None
    padded = global_batch_size if padded_batch_size is None else padded_batch_size
    self._check_sizes(global_batch_size, padded, process_index, process_count)
    self.global_batch_size = int(global_batch_size)
    self.padded_batch_size = int(padded)
    self.process_index = int(process_index)
    self.process_count = int(process_count)
    self.per_host_batch_size = self.padded_batch_size // self.process_count
    self.seed = int(seed)
    self._base_seed = _derive_seed(self.seed)
    self._lock = threading.Lock()
    self._permutations: dict[int, np.ndarray] = {}  # the last two epochs drawn

  def _check_sizes(self, global_batch_size: int, padded: int, process_index: int, process_count: int):
    """Validates batch sizes, host layout and corpus size."""
    if global_batch_size <= 0:
      raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    if padded < global_batch_size:
      raise ValueError(f"padded_batch_size {padded} is smaller than global_batch_size {global_batch_size}")
    if process_count <= 0 or not 0 <= process_index < process_count:
      raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, {process_count}")
    if padded % process_count:
      raise ValueError(f"global batch of {padded} rows (padded_batch_size) is not divisible by "
                       f"process_count {process_count}")
    if self._num_sentences < global_batch_size:
      raise ValueError(f"{self._num_sentences} sentences are fewer than one global batch "
                       f"({global_batch_size})")

  def _check_ids(self, sentence_ids: np.ndarray | None) -> np.ndarray:
    """`sentence_ids` as int32 `[N]`, or `arange(N)` when None."""
    if sentence_ids is None:
      return np.arange(self._num_sentences, dtype=np.int32)
    ids = np.asarray(sentence_ids)
    if ids.shape != (self._num_sentences,) or (ids.size and (ids.min() < 0 or ids.max() >= 2**31)):
      raise ValueError(f"sentence_ids must be {self._num_sentences} non-negative int32 values, "
                       f"got shape {ids.shape}")
    return ids.astype(np.int32)

  def _gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Token rows and sentence ids for row `indices`."""
    if self._rows is not None:
      return self._rows.gather(indices)
    return {**{k: v[indices] for k, v in self.tokens.items()}, SENTENCE_IDS_KEY: self.sentence_ids[indices]}

  @property
  def num_sentences(self) -> int:
    """Sentences in the (sub)corpus."""
    return self._num_sentences

  @property
  def steps_per_epoch(self) -> int:
    """Full global batches per epoch (the remainder is dropped)."""
    return self._num_sentences // self.global_batch_size

  def epoch_of(self, step: int) -> int:
    """The epoch that `step` belongs to."""
    return self._check_step(step) // self.steps_per_epoch

  def _check_step(self, step: int) -> int:
    """Returns `step` as int after checking it is a valid non-negative index."""
    step = int(step)
    if not 0 <= step < sys.maxsize:
      raise ValueError(f"step must be a non-negative integer, got {step}")
    return step

  def _permutation(self, epoch: int) -> np.ndarray:
    """The cached order of `epoch` (`epoch_permutation`), drawn on first use."""
    with self._lock:
      permutation = self._permutations.get(epoch)
      if permutation is None:
        permutation = epoch_permutation(self._base_seed, epoch, self._num_sentences)
        self._permutations = {e: p for e, p in self._permutations.items() if e == epoch - 1}
        self._permutations[epoch] = permutation
      return permutation

  def global_indices(self, step: int) -> np.ndarray:
    """Corpus indices of the real rows of the global batch of `step` (all hosts), int64 `[B]`."""
    epoch, position = divmod(self._check_step(step), self.steps_per_epoch)
    start = position * self.global_batch_size
    return self._permutation(epoch)[start:start + self.global_batch_size].astype(np.int64)

  def global_sentence_ids(self, step: int) -> np.ndarray:
    """Corpus sentence ids of the real rows of the global batch of `step`, int32 `[B]`."""
    if self._rows is not None:
      return self._rows.gather(self.global_indices(step))[SENTENCE_IDS_KEY]
    return self.sentence_ids[self.global_indices(step)]

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """This host's rows of `step`'s padded global batch.

    int32 token arrays `[per_host, length]`, `sentence_ids` `[per_host]` (-1 on padding rows) and
    `row_mask` `[per_host]` (1 real row, 0 padding row, a copy of the global batch's first row).
    """
    indices = self.global_indices(step)
    lo = self.process_index * self.per_host_batch_size
    real = indices[lo:lo + self.per_host_batch_size]  # empty when this host holds only padding
    padding = self.per_host_batch_size - len(real)
    rows = self._gather(np.concatenate([real, indices[:1]]) if padding else real)
    if padding:
      take = np.concatenate([np.arange(len(real)), np.full(padding, len(real))])
      rows = {k: v[take] for k, v in rows.items()}
      rows[SENTENCE_IDS_KEY][len(real):] = PADDING_SENTENCE_ID
    mask = np.zeros(self.per_host_batch_size, np.int32)
    mask[:len(real)] = 1
    rows[ROW_MASK_KEY] = mask
    return rows

  def iterate(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Yields `batch(start_step)`, `batch(start_step + 1)`, ... forever."""
    step = self._check_step(start_step)
    while True:
      yield self.batch(step)
      step += 1

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    """Iterates from step 0."""
    return self.iterate(0)


def build_train_batches(corpus_path: str, tokenizer: Tokenizer, *, max_length: int = DEFAULT_MAX_LENGTH,
                        global_batch_size: int, seed: int, num_sentences: int | None = None,
                        subset_seed: int = 0, process_index: int | None = None,
                        process_count: int | None = None, show_progress: bool = True,
                        padded_batch_size: int | None = None, cache_dir: str | None = None) -> TrainBatches:
  """Reads, subsets and tokenizes a corpus file into `TrainBatches`.

  Args:
    corpus_path: UTF-8 text file, one sentence per line, or a directory written by
      `python -m micse_jax.prepare_data` (its tokenizer and max_length must match).
    tokenizer: a `micse_jax.tokenization.Tokenizer`.
    max_length: fixed padded sequence length.
    global_batch_size: sentences per step over all hosts.
    seed: shuffle seed of the batch schedule.
    num_sentences: few-shot subset size (`None` or <= 0: the whole corpus).
    subset_seed: seed of the few-shot subset.
    process_index: this host; defaults to `jax.process_index()`.
    process_count: number of hosts; defaults to `jax.process_count()`.
    show_progress: show a tqdm bar while tokenizing.
    padded_batch_size: rows per step including padding rows (`TrainBatches`; default the batch).
    cache_dir: folder of tokenised text corpora (`micse_jax.data.token_cache`); None: no cache.
      A whole-corpus run stores the file's tokens there; any run of the same file, tokenizer
      and max length (few-shot subsets included) then reads them instead of tokenising.

  Returns:
    The batch source for this host; its `sentence_ids` are indices into the corpus's
    non-blank lines, duplicates mapped to their first occurrence.

  Raises:
    CorpusError: bad corpus file, subset larger than the corpus, or fewer sentences
      than one global batch.
  """
  corpus_path = os.fspath(corpus_path)
  if os.path.isdir(corpus_path):  # pre-tokenized (python -m micse_jax.prepare_data): rows read on demand
    from micse_jax.data import prepared
    tokens = prepared.open_prepared(corpus_path, tokenizer, max_length, num_sentences, subset_seed)
    count, sentence_ids = len(tokens), None
  else:
    tokens, sentence_ids = _text_corpus_tokens(corpus_path, tokenizer, max_length, num_sentences, subset_seed,
                                               global_batch_size, cache_dir, show_progress)
    count = len(sentence_ids)
  if count < global_batch_size:
    raise CorpusError(f"corpus {corpus_path} gives {count} training sentences, "
                      f"fewer than one global batch of {global_batch_size}")
  if process_index is None:
    process_index = jax.process_index()
  if process_count is None:
    process_count = jax.process_count()
  return TrainBatches(tokens, global_batch_size, seed, process_index, process_count, sentence_ids,
                      padded_batch_size=padded_batch_size)


def _cache_key(corpus_path: str, tokenizer: Tokenizer, max_length: int, cache_dir: str | None) -> str | None:
  """The token-cache key of a readable text file; None without a cache (or an unreadable file,
  which `read_corpus` then reports)."""
  if not cache_dir or not os.path.isfile(corpus_path):
    return None
  try:
    return token_cache.cache_key(corpus_path, tokenizer, max_length)
  except OSError:
    return None


def _text_corpus_tokens(corpus_path: str, tokenizer: Tokenizer, max_length: int, num_sentences: int | None,
                        subset_seed: int, global_batch_size: int, cache_dir: str | None,
                        show_progress: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """(token arrays, sentence ids) of a text corpus's training rows (its few-shot subset): read
  from the token cache when it holds the file, else tokenised; a whole-corpus run stores them.
  A corpus smaller than one batch fails before anything is tokenised."""
  key = _cache_key(corpus_path, tokenizer, max_length, cache_dir)
  cached = token_cache.load(cache_dir, key) if key else None
  sentences = read_corpus(corpus_path) if cached is None else None
  total = len(sentences) if cached is None else len(cached[1])
  try:
    indices = subset_indices(total, num_sentences, subset_seed)
  except CorpusError as e:
    raise CorpusError(f"{corpus_path}: {e}") from e
  if len(indices) < global_batch_size:
    return {}, np.zeros(len(indices), np.int32)  # the caller reports the count
  whole = num_sentences is None or num_sentences <= 0
  if cached is None:
    ids = first_occurrence_ids(sentences)
    if not (key and whole):  # a few-shot subset without a cached corpus: tokenise the subset only
      return tokenize_corpus([sentences[i] for i in indices], tokenizer, max_length,
                             show_progress=show_progress), ids[indices]
    cached = (tokenize_corpus(sentences, tokenizer, max_length, show_progress=show_progress), ids)
    try:
      token_cache.store(cache_dir, key, *cached)
    except OSError as e:
      logging.warning("could not cache the tokenised corpus in %s: %s", cache_dir, e)
  tokens, ids = cached
  return (tokens, ids) if whole else ({k: v[indices] for k, v in tokens.items()}, ids[indices])
