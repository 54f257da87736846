"""Fast row reads from a prepared corpus's ArrayRecord shards, without TFDS's per-row decoding.

A prepared row (`micse_jax.data.prepared`) is a serialized `tf.train.Example` whose three token
features are zlib-compressed int32 bytes (TFDS `Tensor(encoding=ZLIB)`) and whose `sentence_id` is
an int64. TFDS decodes each row through several layers of Python (about 50 µs a row); here a
batch's rows are read with one `ArrayRecordReader.read(sorted indices)` per shard, parsed with
protobuf's C parser, and the token bytes of all rows joined into one buffer per key. Attention
masks and token type ids take few distinct values (a run of ones, all zeros), so their
decompressed bytes are memoised.
"""
from __future__ import annotations

import glob
import os
import zlib

import numpy as np

from micse_jax.optional import require

TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids")
SENTENCE_IDS_KEY = "sentence_ids"
ID_FEATURE = "sentence_id"
_MEMOISED = ("attention_mask", "token_type_ids")
_MEMO_LIMIT = 4096  # distinct compressed values kept per key
_RANDOM_ACCESS = "readahead_buffer_size:0"  # ArrayRecord's setting for random reads


class RecordDecoder:
  """Reads and decodes rows of a prepared corpus's `train` shards (global row index → row)."""

  def __init__(self, paths: list[str], shard_lengths: list[int]):
    reader_class = require("array_record.python.array_record_module",
                           "a prepared (pre-tokenized) corpus").ArrayRecordReader
    self._readers = [reader_class(p, _RANDOM_ACCESS) for p in paths]
    self._starts = np.concatenate([[0], np.cumsum(shard_lengths)]).astype(np.int64)
    self._example = require("tensorflow_datasets.proto",
                            "a prepared (pre-tokenized) corpus").tf_example_pb2.Example
    self._memo = {k: {} for k in _MEMOISED}

  @classmethod
  def open(cls, directory: str, shard_lengths: list[int]) -> "RecordDecoder | None":
    """The decoder of `directory`'s train shards, or None when its files do not match the lengths."""
    paths = sorted(glob.glob(os.path.join(directory, "*-train.array_record-*-of-*")))
    if len(paths) != len(shard_lengths) or not paths:
      return None
    decoder = cls(paths, shard_lengths)
    if [r.num_records() for r in decoder._readers] != [int(n) for n in shard_lengths]:
      return None
    return decoder

  def _read_sorted(self, indices: np.ndarray) -> list[bytes]:
    """Serialized rows of ascending global `indices`, one read call per shard touched."""
    shard_of = np.searchsorted(self._starts, indices, side="right") - 1
    records = []
    for shard in np.unique(shard_of):
      local = indices[shard_of == shard] - self._starts[shard]
      records.extend(self._readers[shard].read(local.tolist()))
    return records

  @staticmethod
  def _remember(memo: dict, compressed: bytes) -> bytes:
    """Decompresses a memoised key's value and keeps it (up to `_MEMO_LIMIT` values)."""
    raw = zlib.decompress(compressed)
    if len(memo) < _MEMO_LIMIT:
      memo[compressed] = raw
    return raw

  def decode(self, records: list[bytes]) -> dict[str, np.ndarray]:
    """int32 `[n, length]` per token key and `sentence_ids` `[n]` from serialized rows."""
    ids, masks, types = [], [], []
    sentence_ids = np.empty(len(records), np.int32)
    parse, decompress, remember = self._example.FromString, zlib.decompress, self._remember
    mask_memo, type_memo = self._memo["attention_mask"], self._memo["token_type_ids"]
    for i, record in enumerate(records):
      feature = parse(record).features.feature
      ids.append(decompress(feature["input_ids"].bytes_list.value[0]))
      mask = feature["attention_mask"].bytes_list.value[0]
      masks.append(mask_memo.get(mask) or remember(mask_memo, mask))
      kind = feature["token_type_ids"].bytes_list.value[0]
      types.append(type_memo.get(kind) or remember(type_memo, kind))
      sentence_ids[i] = feature[ID_FEATURE].int64_list.value[0]
    out = {k: np.frombuffer(b"".join(v), dtype="<i4").reshape(len(records), -1).astype(np.int32)
           for k, v in zip(TOKEN_KEYS, (ids, masks, types))}
    out[SENTENCE_IDS_KEY] = sentence_ids
    return out

  def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Rows `indices` (any order, repeats allowed), read in ascending order and put back in order."""
    indices = np.asarray(indices, dtype=np.int64)
    unique, inverse = np.unique(indices, return_inverse=True)
    rows = self.decode(self._read_sorted(unique))
    return {k: v[inverse] for k, v in rows.items()}
