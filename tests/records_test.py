"""Row decoding of prepared corpora (data/records.py): the batched fixed-layout decoder equals a
protobuf parse of each row, falls back on rows in any other layout, and old zlib corpora still read."""
import zlib

import numpy as np
import pytest

from micse_jax.data.records import FixedLayout, RecordDecoder

tf_example_pb2 = pytest.importorskip("tensorflow_datasets.proto").tf_example_pb2
LENGTH = 6


def _example(ids, mask, types, sentence_id, encode=bytes, extra=None) -> bytes:
  """A tf.Example written directly with protobuf (independent of prepared.py), keys sorted."""
  example = tf_example_pb2.Example()
  feature = example.features.feature
  for key, values in (("input_ids", ids), ("attention_mask", mask), ("token_type_ids", types)):
    feature[key].bytes_list.value.append(encode(np.asarray(values, "<i4").tobytes()))
  feature["sentence_id"].int64_list.value.append(int(sentence_id))
  if extra:
    feature[extra].int64_list.value.append(1)
  return example.SerializeToString(deterministic=True)


def _rows(n, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, 30_522, (n, LENGTH)).astype(np.int32)
  lengths = rng.integers(1, LENGTH + 1, n)
  mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int32)
  types = np.zeros((n, LENGTH), np.int32)
  # one-, two-, three-, four- and five-byte varints, and 0
  sentence_ids = np.array([0, 5, 127, 128, 300, 16_383, 16_384, 2_097_152, 2**31 - 1] * n)[:n].astype(np.int32)
  return ids, mask, types, sentence_ids


def _decoder(compressed):
  decoder = RecordDecoder.__new__(RecordDecoder)  # no shards: only the decoding is under test
  decoder._example = tf_example_pb2.Example
  decoder._memo = {"attention_mask": {}, "token_type_ids": {}}
  decoder._unpack = zlib.decompress if compressed else (lambda raw: raw)
  decoder._fixed = None
  return decoder


def test_fixed_layout_decodes_a_batch_like_the_protobuf_parse():
  ids, mask, types, sentence_ids = _rows(27)
  records = [_example(*row) for row in zip(ids, mask, types, sentence_ids)]
  batch = FixedLayout(LENGTH).decode(records)
  assert batch is not None
  np.testing.assert_array_equal(batch["input_ids"], ids)
  np.testing.assert_array_equal(batch["attention_mask"], mask)
  np.testing.assert_array_equal(batch["token_type_ids"], types)
  np.testing.assert_array_equal(batch["sentence_ids"], sentence_ids)
  assert all(v.dtype == np.int32 for v in batch.values())
  per_row = _decoder(compressed=False).decode_each(records)
  for k, v in per_row.items():
    np.testing.assert_array_equal(batch[k], v)


def test_a_row_in_another_layout_sends_the_batch_to_the_per_row_decoder():
  ids, mask, types, sentence_ids = _rows(5)
  records = [_example(*row) for row in zip(ids, mask, types, sentence_ids)]
  records[3] = _example(ids[3], mask[3], types[3], sentence_ids[3], extra="zzz_other")  # an extra feature
  assert FixedLayout(LENGTH).decode(records) is None
  assert FixedLayout(LENGTH + 1).decode(records[:3]) is None  # another max_length
  decoder = _decoder(compressed=False)
  decoder.use_fixed_layout(LENGTH)
  batch = decoder.decode(records)
  np.testing.assert_array_equal(batch["input_ids"], ids)
  np.testing.assert_array_equal(batch["sentence_ids"], sentence_ids)


def test_zlib_rows_of_older_corpora_still_decode():
  ids, mask, types, sentence_ids = _rows(4, seed=1)
  records = [_example(*row, encode=zlib.compress) for row in zip(ids, mask, types, sentence_ids)]
  assert FixedLayout(LENGTH).decode(records) is None  # not the raw-bytes layout
  batch = _decoder(compressed=True).decode(records)
  np.testing.assert_array_equal(batch["input_ids"], ids)
  np.testing.assert_array_equal(batch["attention_mask"], mask)
  np.testing.assert_array_equal(batch["sentence_ids"], sentence_ids)
