"""Tests for micse_jax.data: corpus reading, few-shot subsets, the batch pipeline."""
import threading

import numpy as np
import pytest

from micse_jax.data import (
  CorpusError,
  TrainBatches,
  build_train_batches,
  read_corpus,
  select_subset,
  subset_indices,
  tokenize_corpus,
)
from micse_jax.tokenization import Tokenizer


def _write(tmp_path, name, data):
  """Writes bytes or text to tmp_path/name; returns the path as str."""
  path = tmp_path / name
  if isinstance(data, bytes):
    path.write_bytes(data)
  else:
    path.write_text(data, encoding="utf-8")
  return str(path)


def _fake_tokens(n, length=4):
  """Token dict whose row i is identifiable: input_ids[i, 0] == i."""
  ids = np.zeros((n, length), dtype=np.int32)
  ids[:, 0] = np.arange(n)
  ids[:, 1] = np.arange(n) * 7
  return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
  return Tokenizer.from_pretrained(minilm_dir)


# ----------------------------------------------------------------------------- corpus


def test_read_corpus_skips_blank_lines_and_strips_endings(tmp_path):
  path = _write(tmp_path, "c.txt", b"first line\r\n\n   \n\tsecond  line \n\r\nthird\n\n")
  assert read_corpus(path) == ["first line", "\tsecond  line ", "third"]


def test_read_corpus_no_trailing_newline_and_unicode(tmp_path):
  path = _write(tmp_path, "c.txt", "caf\u00e9 au lait\n\u65e5\u672c\u8a9e")
  assert read_corpus(path) == ["caf\u00e9 au lait", "\u65e5\u672c\u8a9e"]


def test_missing_file(tmp_path):
  path = str(tmp_path / "nope.txt")
  with pytest.raises(CorpusError, match="not found") as e:
    read_corpus(path)
  _assert_one_line_naming(e.value, path)


def test_empty_file(tmp_path):
  path = _write(tmp_path, "empty.txt", b"")
  with pytest.raises(CorpusError, match="empty") as e:
    read_corpus(path)
  _assert_one_line_naming(e.value, path)


def test_only_blank_lines(tmp_path):
  path = _write(tmp_path, "blank.txt", b"\n  \n\t\r\n\n")
  with pytest.raises(CorpusError, match="only blank lines") as e:
    read_corpus(path)
  _assert_one_line_naming(e.value, path)


def test_non_utf8_names_line_and_offset(tmp_path):
  data = b"good line\nalso good\nbad \xff byte\n"
  path = _write(tmp_path, "latin.txt", data)
  with pytest.raises(CorpusError, match="UTF-8") as e:
    read_corpus(path)
  _assert_one_line_naming(e.value, path)
  assert "line 3" in str(e.value)
  offset = data.index(b"\xff")
  assert f"byte offset {offset}" in str(e.value)


def test_directory(tmp_path):
  with pytest.raises(CorpusError, match="directory") as e:
    read_corpus(str(tmp_path))
  _assert_one_line_naming(e.value, str(tmp_path))


def _assert_one_line_naming(error, path):
  message = str(error)
  assert path in message
  assert "\n" not in message


def test_corpus_error_is_value_error():
  assert issubclass(CorpusError, ValueError)


# ----------------------------------------------------------------------------- subsets


SENTENCES = [f"sentence number {i}" for i in range(200)]


def test_subset_size_determinism_and_membership():
  a = select_subset(SENTENCES, 50, seed=3)
  assert len(a) == 50 and len(set(a)) == 50
  assert set(a) <= set(SENTENCES)
  assert a == select_subset(SENTENCES, 50, seed=3)


def test_subset_nested():
  small = select_subset(SENTENCES, 10, seed=5)
  large = select_subset(SENTENCES, 120, seed=5)
  assert large[:10] == small
  assert set(small) <= set(large)


def test_subset_seed_sensitivity():
  assert select_subset(SENTENCES, 50, seed=0) != select_subset(SENTENCES, 50, seed=1)


@pytest.mark.parametrize("n", [None, 0, -1])
def test_subset_all(n):
  assert select_subset(SENTENCES, n, seed=0) == SENTENCES


def test_subset_too_large():
  with pytest.raises(CorpusError, match="200"):
    select_subset(SENTENCES, 201, seed=0)


def test_subset_full_size_is_permutation():
  full = select_subset(SENTENCES, len(SENTENCES), seed=2)
  assert sorted(full) == sorted(SENTENCES) and full != SENTENCES


# ----------------------------------------------------------------------------- batches


def _rows(batch):
  return batch["input_ids"][:, 0].tolist()


def test_batches_deterministic_and_seed_dependent():
  tokens = _fake_tokens(100)
  a, b = TrainBatches(tokens, 10, seed=1), TrainBatches(tokens, 10, seed=1)
  c = TrainBatches(tokens, 10, seed=2)
  for step in (0, 3, 17):
    for k in a.batch(step):
      np.testing.assert_array_equal(a.batch(step)[k], b.batch(step)[k])
  assert [_rows(a.batch(s)) for s in range(10)] != [_rows(c.batch(s)) for s in range(10)]


def test_batch_shapes_dtypes_and_rows_match_tokens():
  tokens = _fake_tokens(40, length=6)
  ds = TrainBatches(tokens, 8, seed=0)
  batch = ds.batch(3)
  idx = ds.global_indices(3)
  ids = batch.pop("sentence_ids")  # no corpus ids given: the row index is the sentence id
  np.testing.assert_array_equal(ids, idx)
  np.testing.assert_array_equal(batch.pop("row_mask"), np.ones(8, np.int32))  # unpadded: all real
  assert ids.dtype == np.int32
  for k, v in batch.items():
    assert v.shape == (8, 6) and v.dtype == np.int32
    np.testing.assert_array_equal(v, tokens[k][idx])


def test_each_epoch_is_a_permutation_and_epochs_differ():
  n, bsz = 60, 12
  ds = TrainBatches(_fake_tokens(n), bsz, seed=4)
  assert ds.steps_per_epoch == 5
  orders = []
  for epoch in range(3):
    steps = range(epoch * 5, (epoch + 1) * 5)
    assert all(ds.epoch_of(s) == epoch for s in steps)
    order = sum((_rows(ds.batch(s)) for s in steps), [])
    assert sorted(order) == list(range(n))
    orders.append(order)
  assert orders[0] != orders[1] != orders[2] != orders[0]


def test_remainder_dropped_per_epoch():
  n, bsz = 25, 10  # 2 steps per epoch, 5 sentences dropped each epoch
  ds = TrainBatches(_fake_tokens(n), bsz, seed=0)
  assert ds.steps_per_epoch == 2
  assert ds.epoch_of(1) == 0 and ds.epoch_of(2) == 1
  dropped = []
  for epoch in range(4):
    rows = _rows(ds.batch(2 * epoch)) + _rows(ds.batch(2 * epoch + 1))
    assert len(set(rows)) == 20  # no sentence twice within an epoch (or a batch)
    dropped.append(frozenset(range(n)) - set(rows))
  assert len(set(dropped)) > 1  # a different remainder each epoch


def test_host_sharding_reassembles_global_batch():
  tokens = _fake_tokens(64)
  single = TrainBatches(tokens, 16, seed=9)
  hosts = [TrainBatches(tokens, 16, seed=9, process_index=p, process_count=2) for p in range(2)]
  assert hosts[0].per_host_batch_size == 8
  for step in (0, 1, 5, 11):
    whole = single.batch(step)
    for k in whole:
      joined = np.concatenate([h.batch(step)[k] for h in hosts])
      np.testing.assert_array_equal(joined, whole[k])


def test_random_access_equals_sequential():
  ds = TrainBatches(_fake_tokens(30), 7, seed=5)
  it = iter(ds)
  sequential = [next(it) for _ in range(13)]
  for step in reversed(range(13)):
    for k in sequential[step]:
      np.testing.assert_array_equal(ds.batch(step)[k], sequential[step][k])
  resumed = ds.iterate(start_step=8)
  for step in range(8, 13):
    np.testing.assert_array_equal(next(resumed)["input_ids"], sequential[step]["input_ids"])


def test_epoch_order_is_the_documented_numpy_permutation():
  """Independent transcription of the documented scheme: PCG64(SeedSequence([hash(seed), epoch]))."""
  n, bsz, seed = 50, 8, 7
  ds = TrainBatches(_fake_tokens(n), bsz, seed=seed)
  base = int(np.random.SeedSequence(seed).generate_state(1, dtype=np.uint32)[0])
  for epoch in (0, 1, 5):
    order = np.random.Generator(np.random.PCG64(np.random.SeedSequence([base, epoch]))).permutation(n)
    for k in range(ds.steps_per_epoch):
      step = epoch * ds.steps_per_epoch + k
      np.testing.assert_array_equal(ds.global_indices(step), order[k * bsz:(k + 1) * bsz])
      np.testing.assert_array_equal(_rows(ds.batch(step)), order[k * bsz:(k + 1) * bsz])


def test_concurrent_batches_equal_sequential():
  ds, ref = TrainBatches(_fake_tokens(40), 8, seed=3), TrainBatches(_fake_tokens(40), 8, seed=3)
  got = {}
  def read(steps):
    for s in steps:
      got[s] = _rows(ds.batch(s))
  threads = [threading.Thread(target=read, args=(range(i, 60, 3),)) for i in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert got == {s: _rows(ref.batch(s)) for s in range(60)}


@pytest.mark.parametrize("bsz,padded,hosts", [(10, 12, 1), (10, 12, 2), (10, 12, 3), (10, 16, 4), (6, 6, 3)])
def test_padded_batch_host_splits(bsz, padded, hosts):
  tokens = _fake_tokens(37, length=5)
  ids = (np.arange(37) * 3 % 37).astype(np.int32)  # corpus ids differ from row indices
  plain = TrainBatches(tokens, bsz, seed=2, sentence_ids=ids)
  for step in (0, 2, 3, 9):  # epochs 0, 0, 1, 3
    parts = [TrainBatches(tokens, bsz, seed=2, process_index=h, process_count=hosts, sentence_ids=ids,
                          padded_batch_size=padded).batch(step) for h in range(hosts)]
    assert all(len(p["row_mask"]) == padded // hosts for p in parts)
    joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    want = plain.batch(step)
    # real rows: exactly the unpadded run's rows
    for k in want:
      if k != "row_mask":
        np.testing.assert_array_equal(joined[k][:bsz], want[k])
    np.testing.assert_array_equal(joined["row_mask"], (np.arange(padded) < bsz).astype(np.int32))
    assert joined["row_mask"].dtype == np.int32 and joined["sentence_ids"].dtype == np.int32
    # padding rows: the global batch's first row's tokens, sentence id -1
    first = plain.global_indices(step)[0]
    for k in ("input_ids", "attention_mask", "token_type_ids"):
      np.testing.assert_array_equal(joined[k][bsz:], np.repeat(tokens[k][first:first + 1], padded - bsz, 0))
    assert (joined["sentence_ids"][bsz:] == -1).all()


@pytest.mark.parametrize("kwargs", [
    dict(global_batch_size=10, padded_batch_size=8),
    dict(global_batch_size=10, padded_batch_size=12, process_count=5),
    dict(global_batch_size=0),
    dict(global_batch_size=10, process_count=3),
    dict(global_batch_size=10, process_index=2, process_count=2),
    dict(global_batch_size=200),
])
def test_invalid_batch_config(kwargs):
  with pytest.raises(ValueError):
    TrainBatches(_fake_tokens(100), seed=0, **kwargs)


def test_negative_step_rejected():
  with pytest.raises(ValueError):
    TrainBatches(_fake_tokens(10), 5, seed=0).batch(-1)


# ----------------------------------------------------------------------------- tokenization


def test_tokenize_corpus_matches_hf(tokenizer, minilm_dir):
  from transformers import AutoTokenizer
  sentences = ["Hello world.", "A", "The quick brown fox jumps over the lazy dog " * 5,
               "unbelievably tokenization-heavy words", "x y"]
  length = 16
  got = tokenize_corpus(sentences, tokenizer, length, chunk_size=2, show_progress=False)
  hf = AutoTokenizer.from_pretrained(minilm_dir)
  want = hf(sentences, padding="max_length", truncation=True, max_length=length, return_tensors="np")
  for k in ("input_ids", "attention_mask", "token_type_ids"):
    assert got[k].shape == (len(sentences), length) and got[k].dtype == np.int32
    np.testing.assert_array_equal(got[k], want[k])
  lengths = [len(hf(s, truncation=True, max_length=length)["input_ids"]) for s in sentences]
  np.testing.assert_array_equal(got["attention_mask"].sum(1), lengths)
  assert lengths[2] == length  # the long sentence is truncated
  assert (got["input_ids"][got["attention_mask"] == 0] == hf.pad_token_id).all()


def test_build_train_batches_end_to_end(tmp_path, tokenizer):
  lines = [f"this is training sentence {i}." for i in range(23)]
  path = _write(tmp_path, "corpus.txt", "\n".join(lines) + "\n\n")
  ds = build_train_batches(path, tokenizer, max_length=12, global_batch_size=8, seed=0,
                           num_sentences=20, subset_seed=1, process_index=1, process_count=2,
                           show_progress=False)
  assert ds.num_sentences == 20 and ds.steps_per_epoch == 2
  batch = ds.batch(0)
  assert batch["input_ids"].shape == (4, 12)
  subset = select_subset(lines, 20, seed=1)
  want = tokenizer([subset[i] for i in ds.global_indices(0)[4:]], 12, pad_to=12)
  np.testing.assert_array_equal(batch["input_ids"], want["input_ids"])


def test_build_train_batches_defaults_to_jax_process(tmp_path, tokenizer):
  path = _write(tmp_path, "corpus.txt", "\n".join(f"s {i}" for i in range(8)))
  ds = build_train_batches(path, tokenizer, global_batch_size=4, seed=0, show_progress=False)
  assert (ds.process_index, ds.process_count) == (0, 1)
  assert ds.batch(0)["input_ids"].shape == (4, 32)


def test_build_train_batches_too_few_sentences(tmp_path, tokenizer):
  path = _write(tmp_path, "small.txt", "one\ntwo\nthree\n")
  with pytest.raises(CorpusError, match="global batch") as e:
    build_train_batches(path, tokenizer, max_length=8, global_batch_size=4, seed=0)
  _assert_one_line_naming(e.value, path)
  with pytest.raises(CorpusError) as e:
    build_train_batches(path, tokenizer, max_length=8, global_batch_size=2, seed=0, num_sentences=5)
  _assert_one_line_naming(e.value, path)


# ----------------------------------------------------------------------------- real corpus


def test_wiki_corpus_subset(wiki_corpus, tokenizer):
  sentences = read_corpus(wiki_corpus)
  assert len(sentences) > 1000
  assert all(s.strip() for s in sentences)
  subset = select_subset(sentences, 1000, seed=0)
  assert len(subset) == 1000 and set(subset) <= set(sentences)
  indices = subset_indices(len(sentences), 1000, seed=0)
  assert len(set(indices.tolist())) == 1000
  assert subset == [sentences[i] for i in indices]
  assert select_subset(sentences, 100, seed=0) == subset[:100]
  ds = build_train_batches(wiki_corpus, tokenizer, max_length=32, global_batch_size=64, seed=42,
                           num_sentences=1000, subset_seed=0, process_index=0, process_count=1,
                           show_progress=False)
  assert ds.num_sentences == 1000 and ds.steps_per_epoch == 15
  batch = ds.batch(20)
  assert batch["input_ids"].shape == (64, 32)
  assert (batch["attention_mask"][:, 0] == 1).all()
