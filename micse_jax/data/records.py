"""Fast row reads from a prepared corpus's ArrayRecord shards, without TFDS's per-row decoding.

A prepared row (`micse_jax.data.prepared`) is a serialized `tf.train.Example` whose three token
features are zlib-compressed int32 bytes (TFDS `Tensor(encoding=ZLIB)`) and whose `sentence_id` is
an int64. TFDS decodes each row through several layers of Python; here a batch's rows are read
with one range read `ArrayRecordReader.read(i, i + 1)` each, parsed with protobuf's C parser, and
the token bytes of all rows joined into one buffer per key. Attention masks and token type ids take
few distinct values (a run of ones, all zeros), so their decompressed bytes are memoised.

Why one range read per row: `ArrayRecordReader.read(list_of_indices)` (also behind TFDS's and
grain's data sources) costs time in proportion to the shard's record count on every call, even
for one row, so on a full shard (`prepared.ROWS_PER_SHARD` rows) it costs more than a step's
whole host budget; a range read of one record costs the same at any shard size (the times:
BENCHMARKS.md, "One range read per row", measured with `scripts/array_record_reads.py`).

Corpora this release writes store the token arrays as raw bytes (TFDS `Encoding.BYTES`) and
serialize each Example deterministically (map keys sorted), so every row has the same layout:
`FixedLayout` finds the payloads of a whole batch with NumPy index arithmetic instead of one
protobuf parse per row, after checking every row's field headers byte for byte (any row that
does not match sends the batch through the per-row decoder).
"""
from __future__ import annotations

import glob
import os
import threading
import zlib

import numpy as np

from micse_jax.optional import require

TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids")
SENTENCE_IDS_KEY = "sentence_ids"
ID_FEATURE = "sentence_id"
_MEMOISED = ("attention_mask", "token_type_ids")
_MEMO_LIMIT = 4096  # distinct compressed values kept per key
RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"  # ArrayRecord's setting for random reads


def _varint(value: int) -> bytes:
  """Protobuf base-128 varint of a non-negative int."""
  out = bytearray()
  while True:
    out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
    value >>= 7
    if not value:
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
  """A length-delimited protobuf field: tag, varint length, payload."""
  return bytes([number << 3 | 2]) + _varint(len(payload)) + payload


def _token_entry_header(key: str, payload_bytes: int) -> bytes:
  """The bytes of a `Features.feature` map entry for `key` up to its BytesList payload."""
  payload = bytes(payload_bytes)
  entry = _field(1, key.encode()) + _field(2, _field(1, _field(1, payload)))  # key, Feature{BytesList{value}}
  return _field(1, entry)[:-payload_bytes]


class FixedLayout:
  """Vectorised decoding of deterministic rows with raw-byte token arrays (see the module doc).

  Row = `0x0A varint(len) ` + the sorted map entries `attention_mask`, `input_ids`,
  `sentence_id`, `token_type_ids`; the token entries have fixed size, the `sentence_id` entry
  ends in its varint value, and `token_type_ids` ends the row.
  """
  _ID_HEADER = b"\n\x0bsentence_id\x12"  # after the entry's tag and length
  _ID_VALUE_OFFSET = 21              # entry tag/len 2, key 13, Feature tag/len 2, Int64List 2, packed 2

  def __init__(self, max_length: int):
    self.row_bytes = 4 * max_length
    self.headers = {k: np.frombuffer(_token_entry_header(k, self.row_bytes), np.uint8) for k in TOKEN_KEYS}

  def _payloads(self, buf: np.ndarray, starts: np.ndarray, key: str) -> tuple[np.ndarray, bool]:
    """(int32 `[n, max_length]` of `key` for entries starting at `starts`, headers all match)."""
    header = self.headers[key]
    ok = bool(np.all(buf[starts[:, None] + np.arange(len(header))] == header))
    data = buf[starts[:, None] + len(header) + np.arange(self.row_bytes)]
    return np.ascontiguousarray(data).view("<i4").astype(np.int32), ok

  def decode(self, records: list[bytes]) -> dict[str, np.ndarray] | None:
    """The batch dict of `records`, or None when any row is not in this layout."""
    lengths = np.fromiter(map(len, records), np.int64, len(records))
    entry = {k: len(h) + self.row_bytes for k, h in self.headers.items()}
    if len(records) == 0 or lengths.min() < sum(entry.values()) + self._ID_VALUE_OFFSET + 3:
      return None
    buf = np.frombuffer(b"".join(records), np.uint8)
    row = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    if not np.all(buf[row] == 0x0A):
      return None
    b1, b2 = buf[row + 1], buf[row + 2]
    mask_at = row + 2 + (b1 >= 0x80) + ((b1 >= 0x80) & (b2 >= 0x80))  # after the row's tag and length
    ids_at = mask_at + entry["attention_mask"]
    id_at = ids_at + entry["input_ids"]
    types_at = row + lengths - entry["token_type_ids"]
    out, oks = {}, []
    for key, at in (("attention_mask", mask_at), ("input_ids", ids_at), ("token_type_ids", types_at)):
      out[key], ok = self._payloads(buf, at, key)
      oks.append(ok)
    sentence_ids, ok = self._sentence_ids(buf, id_at, types_at)
    if not (all(oks) and ok):
      return None
    out[SENTENCE_IDS_KEY] = sentence_ids
    return out

  def _sentence_ids(self, buf: np.ndarray, entry_at: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, bool]:
    """int32 ids from the `sentence_id` entries (their varint runs to `end`), and headers match."""
    header = np.frombuffer(self._ID_HEADER, np.uint8)
    ok = bool(np.all(buf[entry_at[:, None] + 2 + np.arange(len(header))] == header)
              and np.all(buf[entry_at] == 0x0A) and np.all(buf[entry_at + 1] == end - entry_at - 2))
    start = entry_at + self._ID_VALUE_OFFSET
    size = end - start
    ok = ok and bool(np.all((size >= 1) & (size <= 5)))
    if not ok:
      return np.zeros(len(start), np.int32), False
    positions = np.arange(5)
    raw = buf[np.minimum(start[:, None] + positions, len(buf) - 1)].astype(np.int64)
    groups = np.where(positions < size[:, None], raw & 0x7F, 0)
    values = np.sum(groups << (7 * positions), axis=1)
    return values.astype(np.int32), bool(np.all(values < 2**31))


class RecordDecoder:
  """Reads and decodes rows of a prepared corpus's `train` shards (global row index → row)."""

  def __init__(self, paths: list[str], shard_lengths: list[int], compressed: bool = True):
    reader_class = require("array_record.python.array_record_module",
                           "a prepared (pre-tokenized) corpus").ArrayRecordReader
    self._readers = [reader_class(p, RANDOM_ACCESS) for p in paths]
    self._starts = np.concatenate([[0], np.cumsum(shard_lengths)]).astype(np.int64)
    self._example = require("tensorflow_datasets.proto",
                            "a prepared (pre-tokenized) corpus").tf_example_pb2.Example
    self._memo = {k: {} for k in _MEMOISED}
    self._unpack = zlib.decompress if compressed else (lambda raw: raw)  # token bytes: ZLIB or BYTES
    self._fixed: FixedLayout | None = None  # set by `use_fixed_layout`
    self._lock = threading.Lock()

  @classmethod
  def open(cls, directory: str, shard_lengths: list[int], compressed: bool = True) -> "RecordDecoder | None":
    """The decoder of `directory`'s train shards (token bytes zlib-`compressed` or raw), or None
    when its files do not match the lengths."""
    paths = sorted(glob.glob(os.path.join(directory, "*-train.array_record-*-of-*")))
    if len(paths) != len(shard_lengths) or not paths:
      return None
    decoder = cls(paths, shard_lengths, compressed)
    if [r.num_records() for r in decoder._readers] != [int(n) for n in shard_lengths]:
      return None
    return decoder

  def read_sorted(self, indices: np.ndarray) -> list[bytes]:
    """Serialized rows of ascending global `indices`, one range read per row (module doc)."""
    shard_of = np.searchsorted(self._starts, indices, side="right") - 1
    local = indices - self._starts[shard_of]
    readers = self._readers
    with self._lock:  # a reader is not shared between threads mid-read
      return [readers[s].read(i, i + 1)[0] for s, i in zip(shard_of.tolist(), local.tolist())]

  def _remember(self, memo: dict, compressed: bytes) -> bytes:
    """Decodes a memoised key's value and keeps it (up to `_MEMO_LIMIT` values)."""
    raw = self._unpack(compressed)
    if len(memo) < _MEMO_LIMIT:
      memo[compressed] = raw
    return raw

  def use_fixed_layout(self, max_length: int) -> None:
    """Decode batches with `FixedLayout` first (rows that do not match fall back per row)."""
    self._fixed = FixedLayout(max_length)

  def decode(self, records: list[bytes]) -> dict[str, np.ndarray]:
    """int32 `[n, length]` per token key and `sentence_ids` `[n]` from serialized rows."""
    if self._fixed is not None:
      batch = self._fixed.decode(records)
      if batch is not None:
        return batch
    return self.decode_each(records)

  def decode_each(self, records: list[bytes]) -> dict[str, np.ndarray]:
    """`decode` one protobuf parse per row (any row layout; raw or zlib token bytes)."""
    ids, masks, types = [], [], []
    sentence_ids = np.empty(len(records), np.int32)
    parse, decompress, remember = self._example.FromString, self._unpack, self._remember
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
    rows = self.decode(self.read_sorted(unique))
    return {k: v[inverse] for k, v in rows.items()}
