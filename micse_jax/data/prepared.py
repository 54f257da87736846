"""Pre-tokenized corpora: a TFDS dataset in ArrayRecord shards, read by random access without TF.

`prepare_corpus` streams a text corpus (one sentence per line, the same lines `read_corpus`
keeps) through the tokenizer in chunks and writes one TFDS `train` split in the `array_record`
file format with `disable_shuffling` (row i is the corpus's i-th sentence): the rows go
straight into ArrayRecord shards and `tfds.folder_dataset.write_metadata` describes them.
Memory stays bounded: only one chunk of sentences is held (plus the digests below).

Row layout: the three `TOKEN_KEYS` arrays, int32 `[max_length]`, padded exactly as
`tokenize_corpus` pads, and `sentence_id`, the row of the text's first occurrence (exact
duplicates share it, as `corpus.first_occurrence_ids`), so a prepared corpus gives
bit-identical `TrainBatches`. Finding first occurrences keeps one 16-byte digest per distinct
sentence in memory while preparing (about 0.1 GB per million distinct sentences).
The dataset's metadata records the tokenizer (its name and a fingerprint of its vocabulary
and normalizer), `max_length`, the row count and the source file.

Reading opens the directory with `tfds.builder_from_directory` (metadata, shard lengths; no
TensorFlow) and reads rows straight from the ArrayRecord shards (`micse_jax.data.records`:
one range read per row, batched decoding; TFDS's data source is the fallback). `PreparedRows.gather(indices)`
reads only the requested rows, so each host reads just its share of each step's global batch.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import shutil
import tempfile
from typing import Iterator

import numpy as np

from micse_jax.data.corpus import subset_indices
from micse_jax.data.records import RecordDecoder
from micse_jax.errors import CorpusError
from micse_jax.optional import require
from micse_jax.tokenization import TOKEN_KEYS

SENTENCE_IDS_KEY = "sentence_ids"   # the batch key (micse_jax.data.pipeline.SENTENCE_IDS_KEY)
_ID_FEATURE = "sentence_id"
_BOM = "\ufeff"
_SPLIT = "train"


def is_prepared_dir(path: str) -> bool:
  """True when `path` is a directory written by `prepare_corpus` (a TFDS dataset directory)."""
  return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_info.json"))
          and os.path.isfile(os.path.join(path, "features.json")))


def tokenizer_fingerprint(tokenizer) -> str:
  """sha256 over the vocabulary and the normalizer settings: equal ⇔ the same token ids."""
  hf = tokenizer.hf
  normalizer = getattr(getattr(hf, "backend_tokenizer", None), "normalizer", None)
  payload = json.dumps({"vocab": sorted(hf.get_vocab().items()), "normalizer": str(normalizer),
                        "class": type(hf).__name__})
  return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def iter_corpus_lines(path: str) -> Iterator[str]:
  """Streams the sentences `read_corpus` would return (same splitting, BOM and blank-line rules)."""
  if not os.path.isfile(path):
    raise CorpusError(f"corpus file not found: {path}")
  decoder = codecs.getincrementaldecoder("utf-8")()
  offset = 0
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      try:
        line = decoder.decode(raw)
      except UnicodeDecodeError as e:
        raise CorpusError(f"corpus file is not valid UTF-8: {path}: line {number}, byte offset "
                          f"{offset + e.start} (bytes 0x{raw[e.start:e.end].hex()}: {e.reason})") from e
      offset += len(raw)
      if number == 1 and line.startswith(_BOM):
        line = line[len(_BOM):]
      line = line[:-1] if line.endswith("\n") else line
      line = line[:-1] if line.endswith("\r") else line
      if line.strip():
        yield line


def _row_chunks(path: str, tokenizer, max_length: int, chunk_size: int) -> Iterator[tuple[int, dict]]:
  """(row index, {key: int32 [max_length], sentence_id}) per sentence, tokenized `chunk_size` at a time."""
  chunk, row, first = [], 0, {}

  def flush():
    enc = tokenizer(chunk, max_length, pad_to=max_length)
    for i, sentence in enumerate(chunk):
      digest = hashlib.blake2b(sentence.encode("utf-8"), digest_size=16).digest()
      example = {k: np.asarray(enc[k][i], dtype=np.int32) for k in TOKEN_KEYS}
      example[_ID_FEATURE] = np.int32(first.setdefault(digest, row + i))
      yield row + i, example

  for sentence in iter_corpus_lines(path):
    chunk.append(sentence)
    if len(chunk) == chunk_size:
      yield from flush()
      row += len(chunk)
      chunk = []
  if chunk:
    yield from flush()
    row += len(chunk)
  if row == 0:
    raise CorpusError(f"corpus file has no non-blank lines: {path}")


_DATASET = "pretokenized_corpus"
_PURPOSE = "a prepared (pre-tokenized) corpus"


def _tfds():
  """tensorflow_datasets, imported where used: it is optional and takes seconds to import."""
  return require("tensorflow_datasets", _PURPOSE)

ROWS_PER_SHARD = 1_000_000  # about 0.55 GB of ArrayRecord per shard at max_length 32


def _features(max_length: int):
  """The TFDS features of one row (imported lazily: tensorflow_datasets takes seconds)."""
  tfds = _tfds()
  token_row = lambda: tfds.features.Tensor(shape=(max_length,), dtype=np.int32,
                                           encoding=tfds.features.Encoding.BYTES)
  return tfds.features.FeaturesDict({**{k: token_row() for k in TOKEN_KEYS},
                                     _ID_FEATURE: tfds.features.Scalar(dtype=np.int32)})


def _shard_name(index: int, count: int) -> str:
  """TFDS's default file template `{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}`."""
  return f"{_DATASET}-{_SPLIT}.array_record-{index:05d}-of-{count:05d}"


TOKEN_ENCODING = "bytes"  # raw int32 bytes per token row (one layout per row, `records.FixedLayout`); earlier corpora: "zlib"


def _deterministic(record: bytes) -> bytes:
  """The Example re-serialized with its map keys sorted, so every row has one layout
  (`records.FixedLayout` decodes a batch of such rows without a parse per row)."""
  example = require("tensorflow_datasets.proto", _PURPOSE).tf_example_pb2.Example.FromString(record)
  return example.SerializeToString(deterministic=True)


# One record per chunk (random reads decode only the rows asked for) and no chunk compression:
# the token bytes are already zlib-compressed by TFDS, and decompressing a zstd chunk per row
# slowed random reads down (BENCHMARKS.md, "No chunk compression in prepared shards").
WRITER_OPTIONS = "group_size:1,uncompressed"


def _write_shards(rows: Iterator[tuple[int, dict]], features, directory: str,
                  rows_per_shard: int) -> tuple[list[int], int]:
  """Writes serialized rows, in order, into ArrayRecord shards; returns (shard lengths, bytes).

  Rows go straight to disk: TFDS's own generator path buffers up to 1 GB and then spills
  through `tf.io.gfile`, which needs TensorFlow, so it fails above ~3M sentences without it.
  """
  ArrayRecordWriter = require("array_record.python.array_record_module", _PURPOSE).ArrayRecordWriter
  lengths, num_bytes, writer = [], 0, None
  for _, example in rows:
    if writer is None or lengths[-1] == rows_per_shard:
      if writer is not None:
        writer.close()
      writer = ArrayRecordWriter(os.path.join(directory, f"shard-{len(lengths):05d}.tmp"), WRITER_OPTIONS)
      lengths.append(0)
    record = _deterministic(features.serialize_example(example))
    writer.write(record)
    lengths[-1] += 1
    num_bytes += len(record)
  if writer is not None:
    writer.close()
  for i in range(len(lengths)):
    os.replace(os.path.join(directory, f"shard-{i:05d}.tmp"),
               os.path.join(directory, _shard_name(i, len(lengths))))
  return lengths, num_bytes


def prepare_corpus(corpus: str, tokenizer, tokenizer_name: str, max_length: int, output: str,
                   chunk_size: int = 8192, rows_per_shard: int = ROWS_PER_SHARD) -> dict:
  """Tokenizes `corpus` once into a prepared directory `output`; returns its metadata.

  Streams the corpus (one chunk of sentences in memory at a time) into ArrayRecord shards of
  `rows_per_shard` rows, then writes the TFDS metadata (`tfds.folder_dataset.write_metadata`).
  Everything is written to a temporary directory beside `output` and renamed at the end, so
  `output` is either complete or absent.

  Raises:
    CorpusError: bad corpus, non-positive `max_length`, or `output` already exists.
  """
  tfds = _tfds()
  if max_length <= 0:
    raise CorpusError(f"max_length must be positive, got {max_length}")
  if os.path.exists(output):
    raise CorpusError(f"output already exists: {output} (remove it or choose another --output)")
  if not os.path.isfile(corpus):
    raise CorpusError(f"corpus file not found: {corpus}")
  metadata = {"tokenizer": tokenizer_name, "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
              "max_length": int(max_length), "source": os.path.abspath(corpus),
              "token_encoding": TOKEN_ENCODING}
  parent = os.path.dirname(os.path.abspath(output))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".prepare-", dir=parent)
  try:
    features = _features(max_length)
    lengths, num_bytes = _write_shards(_row_chunks(corpus, tokenizer, max_length, chunk_size),
                                       features, tmp, rows_per_shard)
    tfds.folder_dataset.write_metadata(
        data_dir=tmp, features=features, check_data=False,
        split_infos=[tfds.core.SplitInfo(name=_SPLIT, shard_lengths=lengths, num_bytes=num_bytes)],
        description="Pre-tokenized sentences (micse_jax.prepare_data).", disable_shuffling=True,
        metadata=tfds.core.MetadataDict(metadata))
    os.replace(tmp, output)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return PreparedRows(output).metadata


class PreparedRows:
  """Random-access token rows of a prepared directory; `gather(indices)` reads only those rows.

  Rows are read straight from the ArrayRecord shards (`RecordDecoder`: one range read per row,
  whose cost does not grow with the shard; a batch's rows decoded together by NumPy index
  arithmetic, or per row by protobuf's C parser), several times faster than TFDS's data source.
  At open, a few rows decoded both ways must agree; otherwise (an unexpected layout) TFDS's
  data source decodes every row.
  """

  def __init__(self, path: str):
    tfds = _tfds()
    if not is_prepared_dir(path):
      raise CorpusError(f"corpus path is a directory but not a prepared corpus (no dataset_info.json; "
                        f"write one with python -m micse_jax.prepare_data): {path}")
    self.path = path
    builder = tfds.builder_from_directory(path)
    self.metadata = dict(builder.info.metadata or {})
    self._source = builder.as_data_source(split=_SPLIT)
    self.metadata["num_sentences"] = len(self._source)
    compressed = self.metadata.get("token_encoding", "zlib") == "zlib"
    self._fast = RecordDecoder.open(path, list(builder.info.splits[_SPLIT].shard_lengths), compressed)
    if self._fast is not None and not compressed:
      self._fast.use_fixed_layout(int(self.metadata["max_length"]))
    if self._fast is not None and not self._fast_path_agrees():
      self._fast = None

  def __len__(self) -> int:
    return len(self._source)

  def _fast_path_agrees(self) -> bool:
    """The direct decoding (per row and, where set, batched) equals TFDS's on a few rows."""
    probe = np.unique(np.asarray([0, len(self) // 2, len(self) - 1]))
    try:
      slow = self._tfds_gather(probe)
      records = self._fast.read_sorted(probe)
      decoded = [self._fast.decode_each(records), self._fast.decode(records)]
    except Exception:  # any layout surprise: use TFDS
      return False
    return all(d[k].shape == slow[k].shape and np.array_equal(d[k], slow[k]) for d in decoded for k in slow)

  def _tfds_gather(self, indices) -> dict[str, np.ndarray]:
    records = self._source.__getitems__([int(i) for i in indices])
    batch = {k: np.stack([r[k] for r in records]).astype(np.int32, copy=False) for k in TOKEN_KEYS}
    batch[SENTENCE_IDS_KEY] = np.asarray([r[_ID_FEATURE] for r in records], dtype=np.int32)
    return batch

  def gather(self, indices) -> dict[str, np.ndarray]:
    """Rows `indices`: int32 token arrays `[len(indices), max_length]` and `sentence_ids` `[len(indices)]`."""
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if self._fast is None:
      return self._tfds_gather(indices)
    return self._fast.gather(indices)


class SubsetRows:
  """A few-shot subset of `PreparedRows`: row j is corpus row `subset_indices(...)[j]`."""

  def __init__(self, rows: PreparedRows, corpus_rows: np.ndarray | None):
    self.rows, self.corpus_rows = rows, corpus_rows

  def __len__(self) -> int:
    return len(self.rows) if self.corpus_rows is None else len(self.corpus_rows)

  def gather(self, indices) -> dict[str, np.ndarray]:
    """Rows `indices` of the subset (positions in it, mapped to corpus rows)."""
    indices = np.asarray(indices, dtype=np.int64)
    return self.rows.gather(indices if self.corpus_rows is None else self.corpus_rows[indices])


def check_compatible(metadata: dict, path: str, tokenizer, max_length: int) -> None:
  """Raises CorpusError (one line) when the prepared data do not fit the model's tokenizer/length."""
  if metadata.get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer):
    raise CorpusError(f"prepared corpus {path} was tokenized with {metadata.get('tokenizer')!r}, whose "
                      "vocabulary/normalization differ from the model's tokenizer; re-run "
                      "python -m micse_jax.prepare_data with the model's --tokenizer")
  if int(metadata.get("max_length", -1)) != int(max_length):
    raise CorpusError(f"prepared corpus {path} has max_length {metadata.get('max_length')}, but "
                      f"model.max_length is {max_length}; re-run prepare_data with --max_length {max_length}")


def open_prepared(path: str, tokenizer, max_length: int, num_sentences: int | None,
                  subset_seed: int) -> SubsetRows:
  """Opens and checks a prepared corpus; applies the same few-shot subset as the text path."""
  rows = PreparedRows(path)
  check_compatible(rows.metadata, path, tokenizer, max_length)
  try:
    subset = None if not num_sentences or num_sentences <= 0 else subset_indices(
        len(rows), num_sentences, subset_seed)
  except CorpusError as e:
    raise CorpusError(f"{path}: {e}") from e
  return SubsetRows(rows, subset)


def corpus_size(path: str) -> int:
  """Number of training sentences of a text corpus or a prepared directory (without tokenizing)."""
  if is_prepared_dir(path):
    with open(os.path.join(path, "dataset_info.json"), encoding="utf-8") as f:
      info = json.load(f)
    return sum(int(n) for split in info.get("splits", []) if split.get("name") == _SPLIT
               for n in split.get("shardLengths", []))
  return sum(1 for _ in iter_corpus_lines(path))
