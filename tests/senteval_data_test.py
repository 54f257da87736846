"""SentEval readers: counts on the real data, clear one-line errors on malformed files."""
import os

import numpy as np
import pytest

from micse_jax.evaluation import senteval_data as sd
from micse_jax.evaluation.senteval_data import SentEvalDataError

STS_COUNTS = {"STS12": 3108, "STS13": 1500, "STS14": 3750, "STS15": 3000, "STS16": 1186}


def _write(path, text, encoding="utf-8"):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding=encoding, newline="") as f:
    f.write(text)
  return str(path)


def _error(fn, *args) -> str:
  with pytest.raises(SentEvalDataError) as info:
    fn(*args)
  message = str(info.value)
  assert "\n" not in message
  return message


# ------------------------------------------------------------------ real data

@pytest.mark.parametrize("task", sorted(STS_COUNTS))
def test_sts_year_counts(senteval_dir, task):
  subsets = sd.load_sts_year(senteval_dir, task)
  assert sum(len(p.scores) for p in subsets.values()) == STS_COUNTS[task]
  for pairs in subsets.values():
    assert len(pairs.sentences1) == len(pairs.sentences2) == len(pairs.scores)
    assert pairs.scores.dtype == np.float64
    assert 0.0 <= pairs.scores.min() and pairs.scores.max() <= 5.0


def test_sts13_has_no_smt(senteval_dir):
  assert list(sd.load_sts_year(senteval_dir, "STS13")) == ["FNWN", "headlines", "OnWN"]


def test_stsb_and_sickr_counts(senteval_dir):
  stsb, sick = sd.load_stsb(senteval_dir), sd.load_sickr(senteval_dir)
  assert {k: len(v.scores) for k, v in stsb.items()} == {"train": 5749, "dev": 1500, "test": 1379}
  assert {k: len(v.scores) for k, v in sick.items()} == {"train": 4500, "dev": 500, "test": 4927}
  assert sick["test"].sentences1[0].startswith("There is no boy playing outdoors")
  assert sick["test"].scores[0] == pytest.approx(3.3)


def test_transfer_counts(senteval_dir):
  for task, n in {"MR": 10662, "CR": 3775, "SUBJ": 10000, "MPQA": 10606}.items():
    data = sd.load_binary(senteval_dir, task)
    assert len(data.sentences) == len(data.labels) == n
    assert set(np.unique(data.labels)) == {0, 1}
  sizes = lambda splits: {k: len(v.labels) for k, v in splits.items()}
  assert sizes(sd.load_sst2(senteval_dir)) == {"train": 67349, "dev": 872, "test": 1821}
  trec = sd.load_trec(senteval_dir)
  assert sizes(trec) == {"train": 5452, "test": 500}
  assert np.bincount(trec["test"].labels).tolist() == [9, 138, 94, 65, 81, 113]
  assert trec["test"].sentences[0] == "How far is it from Denver to Aspen ?"
  mrpc = sd.load_mrpc(senteval_dir)
  assert sizes(mrpc) == {"train": 4076, "test": 1725}
  assert mrpc["train"].labels[:2].tolist() == [1, 0]


def test_validate_all_tasks(senteval_dir):
  sd.validate_tasks(senteval_dir, sd.ALL_TASKS)


# ------------------------------------------------------------------ names and layout

def test_resolve_tasks():
  assert sd.resolve_tasks("sts") == list(sd.STS7)
  assert sd.resolve_tasks("transfer") == list(sd.TRANSFER7)
  assert sd.resolve_tasks("all") == list(sd.STS7 + sd.TRANSFER7)
  assert sd.resolve_tasks("mrpc, sick-r,STS-B,sts12") == ["STS12", "STSBenchmark",
                                                          "SICKRelatedness", "MRPC"]
  with pytest.raises(ValueError, match="unknown task 'STS17'"):
    sd.resolve_tasks("STS12,STS17")
  with pytest.raises(ValueError):
    sd.resolve_tasks(" , ")


def test_missing_directory_names_layout_and_download(tmp_path):
  message = _error(sd.load_stsb, str(tmp_path / "nowhere"))
  assert "nowhere" in message and sd.SENTEVAL_URL in message and "STSBenchmark" in message


def test_missing_file_is_named(tmp_path):
  message = _error(sd.load_sickr, str(tmp_path))
  assert os.path.join("SICK", "SICK_train.txt") in message and "not found" in message


def test_normalize_whitespace():
  assert sd.normalize("  a  b\tc \u00a0") == "a b c"


# ------------------------------------------------------------------ synthetic files

def _sts_dir(tmp_path, inputs, golds, subset="FNWN"):
  folder = tmp_path / "STS" / "STS13-en-test"
  _write(folder / f"STS.input.{subset}.txt", inputs)
  _write(folder / f"STS.gs.{subset}.txt", golds)
  return str(folder)


def test_sts_subset_skips_empty_gold_and_normalizes(tmp_path):
  folder = _sts_dir(tmp_path, "A  cat .\tA dog .\nx\ty\r\nOne\tTwo\n", "4.5\n\n1\n")
  pairs = sd.read_sts_subset(folder, "FNWN")
  assert pairs.sentences1 == ["A cat .", "One"] and pairs.sentences2 == ["A dog .", "Two"]
  np.testing.assert_array_equal(pairs.scores, [4.5, 1.0])


def test_sts_wrong_column_count(tmp_path):
  folder = _sts_dir(tmp_path, "a\tb\nonly one sentence\n", "1\n2\n")
  message = _error(sd.read_sts_subset, folder, "FNWN")
  assert "STS.input.FNWN.txt:2:" in message
  assert "expected 2 tab-separated fields, found 1" in message


def test_sts_non_numeric_gold(tmp_path):
  folder = _sts_dir(tmp_path, "a\tb\nc\td\n", "1\nhigh\n")
  message = _error(sd.read_sts_subset, folder, "FNWN")
  assert "STS.gs.FNWN.txt:2:" in message and "'high' is not a number" in message


def test_sts_line_count_mismatch(tmp_path):
  folder = _sts_dir(tmp_path, "a\tb\nc\td\ne\tf\n", "1\n2\n")
  message = _error(sd.read_sts_subset, folder, "FNWN")
  assert "STS.gs.FNWN.txt" in message and "2 gold lines" in message and "3 sentence-pair" in message


def test_stsb_extra_fields_and_errors(tmp_path):
  good = "g\tf\t2012\t1\t2.5\tA b .\tC d .\textra\tmore\n"
  path = _write(tmp_path / "sts-test.csv", good)
  pairs = sd.read_stsb_split(path)
  assert pairs.sentences1 == ["A b ."] and pairs.sentences2 == ["C d ."] and pairs.scores[0] == 2.5
  _write(tmp_path / "short.csv", good + "g\tf\t2012\t2\t3.0\tonly one\n")
  message = _error(sd.read_stsb_split, str(tmp_path / "short.csv"))
  assert "short.csv:2: expected at least 7" in message
  _write(tmp_path / "nan.csv", good.replace("2.5", "n/a"))
  assert "nan.csv:1: score 'n/a'" in _error(sd.read_stsb_split, str(tmp_path / "nan.csv"))


def test_sick_header_and_rows(tmp_path):
  header = "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\r\n"
  path = _write(tmp_path / "SICK_trial.txt", header + "1\tA b\tC d\t3.3\tNEUTRAL\r\n")
  pairs = sd.read_sick_split(path)
  assert pairs.sentences1 == ["A b"] and pairs.scores[0] == pytest.approx(3.3)
  _write(tmp_path / "bad_header.txt", "pair_ID\tsentence_A\tsentence_B\tscore\n1\ta\tb\t1\n")
  assert "bad_header.txt:1: header lacks column(s) relatedness_score" in _error(
      sd.read_sick_split, str(tmp_path / "bad_header.txt"))
  _write(tmp_path / "bad_row.txt", header + "1\tA b\tC d\t3.3\n")
  assert "bad_row.txt:2: expected 5" in _error(sd.read_sick_split, str(tmp_path / "bad_row.txt"))


def test_sst_trec_mrpc_errors(tmp_path):
  _write(tmp_path / "sst", "good film \t1\nbad film \t2\n")
  assert "sst:2: label '2' is not one of ['0', '1']" in _error(sd.read_sst_split,
                                                               str(tmp_path / "sst"))
  _write(tmp_path / "trec", "NUM:dist How far ?\nWHAT is this\n", "latin-1")
  assert "trec:2: expected 'COARSE:fine question'" in _error(sd.read_trec_split,
                                                            str(tmp_path / "trec"))
  _write(tmp_path / "trec2", "XYZ:dist How far ?\n", "latin-1")
  assert "trec2:1: label 'XYZ'" in _error(sd.read_trec_split, str(tmp_path / "trec2"))
  _write(tmp_path / "mrpc", "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\ta b\n")
  assert "mrpc:2: expected 5" in _error(sd.read_mrpc_split, str(tmp_path / "mrpc"))


def test_trec_is_latin1(tmp_path):
  _write(tmp_path / "trec", "HUM:ind Who is Andr\u00e9 ?\n", "latin-1")
  data = sd.read_trec_split(str(tmp_path / "trec"))
  assert data.sentences == ["Who is Andr\u00e9 ?"] and data.labels.tolist() == [3]


def test_invalid_utf8_reports_line(tmp_path):
  path = tmp_path / "sts-dev.csv"
  path.write_bytes(b"g\tf\t2012\t1\t2.5\ta\tb\ng\tf\t2012\t2\t1.0\t\xff\tb\n")
  assert "sts-dev.csv:2: not valid utf-8" in _error(sd.read_stsb_split, str(path))
