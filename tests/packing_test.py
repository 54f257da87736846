"""The packed host batch (data/packing.py): one array that unpacks to the same batch, on the devices too."""
import jax
import numpy as np
import pytest

from micse_jax.data.packing import BatchLayout
from micse_jax.training import data_parallel


def _batch(rows=6, length=5, seed=0):
  rng = np.random.default_rng(seed)
  return {"input_ids": rng.integers(0, 30_000, (rows, length)).astype(np.int32),
          "attention_mask": (rng.random((rows, length)) > 0.3).astype(np.int32),
          "token_type_ids": np.zeros((rows, length), np.int32),
          "sentence_ids": rng.integers(-1, 1000, rows).astype(np.int32),
          "row_mask": np.array([1] * (rows - 1) + [0], np.int32)}


def test_pack_puts_columns_side_by_side_and_unpack_restores_them():
  batch = _batch()
  layout = BatchLayout.of(batch)
  packed = layout.pack(batch)
  assert packed.dtype == np.int32 and packed.shape == (6, 3 * 5 + 2) and layout.columns == 17
  # keys in sorted order: attention_mask, input_ids, row_mask, sentence_ids, token_type_ids
  np.testing.assert_array_equal(packed[:, 0:5], batch["attention_mask"])
  np.testing.assert_array_equal(packed[:, 5:10], batch["input_ids"])
  np.testing.assert_array_equal(packed[:, 10], batch["row_mask"])
  np.testing.assert_array_equal(packed[:, 11], batch["sentence_ids"])
  np.testing.assert_array_equal(packed[:, 12:17], batch["token_type_ids"])
  back = layout.unpack(packed)
  assert sorted(back) == sorted(batch)
  for k, v in batch.items():
    assert back[k].shape == v.shape
    np.testing.assert_array_equal(back[k], v)


def test_placed_packed_batch_unpacks_inside_jit_to_the_host_batch():
  batch = _batch(rows=4)
  layout = BatchLayout.of(batch)
  mesh = data_parallel.data_mesh()
  placed = data_parallel.global_batch(layout.pack(batch), mesh)
  assert placed.sharding.is_equivalent_to(data_parallel.batch_sharded(mesh), placed.ndim)
  unpacked = jax.jit(layout.unpack)(placed)
  for k, v in batch.items():
    np.testing.assert_array_equal(np.asarray(unpacked[k]), v)


@pytest.mark.parametrize("bad", [
    {"a": np.zeros((2, 3), np.int64)},                              # not int32
    {"a": np.zeros((2, 3), np.int32), "b": np.zeros(3, np.int32)},  # rows differ
    {"a": np.zeros((2, 3, 4), np.int32)},                           # 3-D
])
def test_layout_refuses_what_it_cannot_pack(bad):
  with pytest.raises(ValueError, match="packed batch"):
    BatchLayout.of(bad)


def test_pack_refuses_other_keys():
  layout = BatchLayout.of(_batch())
  with pytest.raises(ValueError, match="differ"):
    layout.pack({"input_ids": np.zeros((6, 5), np.int32)})
