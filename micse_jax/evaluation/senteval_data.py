"""Readers for SentEval's `data/downstream` tree: STS12-16, STS-B, SICK-R, seven transfer tasks.

Everything is returned as plain Python / NumPy structures. Sentences are whitespace-normalised
(`" ".join(s.split())`), which is what SentEval's tokenisation by `str.split` followed by
SimCSE's `" ".join(tokens)` batcher hands to a model. Samples keep SentEval's order and counts
(blank review lines in CR/MPQA stay as empty sentences, as SentEval keeps them).

Any malformed file raises `SentEvalDataError` (a `ValueError`) whose message is one line naming
the file and, where it applies, the line number.
"""
from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import urllib.request
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from micse_jax.errors import SentEvalDataError  # re-exported

SENTEVAL_URL = ("https://huggingface.co/datasets/princeton-nlp/datasets-for-simcse/"
                "resolve/main/senteval.tar")
LAYOUT = ("STS/STS12-en-test ... STS/STS16-en-test, STS/STSBenchmark, SICK, MR, CR, SUBJ, MPQA, "
          "SST/binary, TREC, MRPC")

# STS year -> (folder under STS/, subsets). STS13 has no SMT subset (licence), as in SimCSE.
STS_YEARS = {
    "STS12": ("STS12-en-test", ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN",
                                "surprise.SMTnews")),
    "STS13": ("STS13-en-test", ("FNWN", "headlines", "OnWN")),
    "STS14": ("STS14-en-test", ("deft-forum", "deft-news", "headlines", "images", "OnWN",
                                "tweet-news")),
    "STS15": ("STS15-en-test", ("answers-forums", "answers-students", "belief", "headlines",
                                "images")),
    "STS16": ("STS16-en-test", ("answer-answer", "headlines", "plagiarism", "postediting",
                                "question-question")),
}
STS7 = ("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness")
TRANSFER7 = ("MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC")
# How a transfer task is scored (`eval.transfer_protocol`, `micse-evaluate --transfer_protocol`):
# SentEval's own classifier (the papers') or our L-BFGS logistic regression (evaluation/transfer.py).
TRANSFER_PROTOCOLS = ("senteval", "logreg")
ALL_TASKS = STS7 + TRANSFER7
TASK_GROUPS = {"sts": STS7, "transfer": TRANSFER7, "all": ALL_TASKS}
_ALIASES = {"STSB": "STSBenchmark", "STS-B": "STSBenchmark", "SICKR": "SICKRelatedness",
            "SICK-R": "SICKRelatedness", "SICK": "SICKRelatedness"}
_BY_UPPER = {**{t.upper(): t for t in ALL_TASKS}, **_ALIASES}

BINARY_FILES = {"MR": ("MR", "rt-polarity.pos", "rt-polarity.neg"),
                "CR": ("CR", "custrev.pos", "custrev.neg"),
                "SUBJ": ("SUBJ", "subj.objective", "subj.subjective"),
                "MPQA": ("MPQA", "mpqa.pos", "mpqa.neg")}
SEED = 1111  # SentEval's seed for the transfer-task folds (the one place it is defined)
TREC_LABELS = ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM")


class SentencePairs(NamedTuple):
  """Scored sentence pairs (STS, SICK-R); `scores` is float64 `[n]`."""
  sentences1: list[str]
  sentences2: list[str]
  scores: np.ndarray


class LabeledSentences(NamedTuple):
  """Single-sentence classification samples; `labels` is int64 `[n]`."""
  sentences: list[str]
  labels: np.ndarray


class LabeledPairs(NamedTuple):
  """Sentence-pair classification samples (MRPC); `labels` is int64 `[n]`."""
  sentences1: list[str]
  sentences2: list[str]
  labels: np.ndarray


def resolve_tasks(spec: str | Sequence[str]) -> list[str]:
  """Canonical task names, in paper order, for `sts`, `transfer`, `all` or a comma list."""
  names = spec.split(",") if isinstance(spec, str) else list(spec)
  wanted = set()
  for raw in names:
    name = raw.strip()
    if not name:
      continue
    if name.lower() in TASK_GROUPS:
      wanted.update(TASK_GROUPS[name.lower()])
      continue
    canonical = _BY_UPPER.get(name.upper())
    if canonical is None:
      raise ValueError(f"unknown task {name!r}; known: sts, transfer, all, {', '.join(ALL_TASKS)}"
                       ", STS-B, SICK-R")
    wanted.add(canonical)
  if not wanted:
    raise ValueError(f"no task named in {spec!r}")
  return [t for t in ALL_TASKS if t in wanted]


def check_senteval_dir(senteval_dir: str) -> None:
  """Raises `SentEvalDataError` naming the expected layout if the directory does not exist."""
  if not senteval_dir or not os.path.isdir(senteval_dir):
    raise SentEvalDataError(
        f"SentEval data directory not found: {senteval_dir!r}; expected the SentEval "
        f"data/downstream layout ({LAYOUT}); get it with --download or from {SENTEVAL_URL}")


def normalize(sentence: str) -> str:
  """SentEval tokenises with `str.split`; SimCSE's batcher joins the tokens with spaces."""
  return " ".join(sentence.split())


def read_lines(path: str, encoding: str = "utf-8") -> list[str]:
  """Lines of a text file without line terminators (\\n, \\r\\n or \\r)."""
  if not os.path.isfile(path):
    raise SentEvalDataError(f"{path}: file not found (expected the SentEval layout: {LAYOUT}; "
                            f"download: {SENTEVAL_URL})")
  with open(path, "rb") as f:
    data = f.read()
  try:
    text = data.decode(encoding)
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b"\n") + 1
    raise SentEvalDataError(f"{path}:{line}: not valid {encoding} text") from e
  lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
  if lines and lines[-1] == "":
    lines.pop()
  return lines


def _fields(line: str, path: str, lineno: int, count: int, exact: bool = True) -> list[str]:
  """Tab-separated fields of one line; `count` of them (at least `count` if not `exact`)."""
  fields = line.split("\t")
  if len(fields) < count or (exact and len(fields) != count):
    want = f"{count}" if exact else f"at least {count}"
    raise SentEvalDataError(f"{path}:{lineno}: expected {want} tab-separated fields, "
                            f"found {len(fields)}")
  return fields


def _number(text: str, path: str, lineno: int, what: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = float("nan")
  if not np.isfinite(value):
    raise SentEvalDataError(f"{path}:{lineno}: {what} {text.strip()!r} is not a number")
  return value


def _label(text: str, allowed: Sequence[str], path: str, lineno: int) -> int:
  value = text.strip()
  if value not in allowed:
    raise SentEvalDataError(f"{path}:{lineno}: label {value!r} is not one of {list(allowed)}")
  return allowed.index(value)


def _pairs(rows: list[tuple[str, str, float]]) -> SentencePairs:
  return SentencePairs([normalize(r[0]) for r in rows], [normalize(r[1]) for r in rows],
                       np.asarray([r[2] for r in rows], dtype=np.float64))


def read_sts_subset(folder: str, subset: str) -> SentencePairs:
  """One STS12-16 subset (`STS.input.<subset>.txt`, `STS.gs.<subset>.txt`) minus unscored pairs."""
  input_path = os.path.join(folder, f"STS.input.{subset}.txt")
  gold_path = os.path.join(folder, f"STS.gs.{subset}.txt")
  inputs, golds = read_lines(input_path), read_lines(gold_path)
  if len(inputs) != len(golds):
    raise SentEvalDataError(f"{gold_path}:{min(len(inputs), len(golds)) + 1}: {len(golds)} gold "
                            f"lines but {input_path} has {len(inputs)} sentence-pair lines")
  rows = []
  for lineno, (pair, gold) in enumerate(zip(inputs, golds), start=1):
    first, second = _fields(pair, input_path, lineno, 2)
    if gold.strip():
      rows.append((first, second, _number(gold, gold_path, lineno, "gold score")))
  return _pairs(rows)


def load_sts_year(senteval_dir: str, task: str) -> dict[str, SentencePairs]:
  """All subsets of one STS year (`STS12` ... `STS16`), in SentEval's subset order."""
  check_senteval_dir(senteval_dir)
  folder, subsets = STS_YEARS[task]
  folder = os.path.join(senteval_dir, "STS", folder)
  return {subset: read_sts_subset(folder, subset) for subset in subsets}


def read_stsb_split(path: str) -> SentencePairs:
  """An STS-B csv: tab-separated genre, file, year, id, score, sentence1, sentence2[, extra...]."""
  rows = []
  for lineno, line in enumerate(read_lines(path), start=1):
    fields = _fields(line, path, lineno, 7, exact=False)
    rows.append((fields[5], fields[6], _number(fields[4], path, lineno, "score")))
  return _pairs(rows)


def read_sick_split(path: str) -> SentencePairs:
  """A SICK file: header line, then sentence_A, sentence_B, relatedness_score columns."""
  lines = read_lines(path)
  header = lines[0].split("\t") if lines else []
  columns = ("sentence_A", "sentence_B", "relatedness_score")
  missing = [c for c in columns if c not in header]
  if missing:
    raise SentEvalDataError(f"{path}:1: header lacks column(s) {', '.join(missing)}")
  a, b, score = (header.index(c) for c in columns)
  rows = []
  for lineno, line in enumerate(lines[1:], start=2):
    fields = _fields(line, path, lineno, len(header))
    rows.append((fields[a], fields[b], _number(fields[score], path, lineno, "relatedness_score")))
  return _pairs(rows)


def load_stsb(senteval_dir: str) -> dict[str, SentencePairs]:
  """STS-B `train`, `dev`, `test` from `STS/STSBenchmark/sts-*.csv`."""
  check_senteval_dir(senteval_dir)
  folder = os.path.join(senteval_dir, "STS", "STSBenchmark")
  return {split: read_stsb_split(os.path.join(folder, f"sts-{split}.csv"))
          for split in ("train", "dev", "test")}


def load_sickr(senteval_dir: str) -> dict[str, SentencePairs]:
  """SICK-R `train`, `dev` (SICK_trial) and `test` (SICK_test_annotated)."""
  check_senteval_dir(senteval_dir)
  files = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}
  return {split: read_sick_split(os.path.join(senteval_dir, "SICK", name))
          for split, name in files.items()}


def load_sts_task(senteval_dir: str, task: str) -> dict[str, SentencePairs]:
  """Subsets of an STS year, or the splits of STSBenchmark / SICKRelatedness."""
  if task in STS_YEARS:
    return load_sts_year(senteval_dir, task)
  if task == "STSBenchmark":
    return load_stsb(senteval_dir)
  if task == "SICKRelatedness":
    return load_sickr(senteval_dir)
  raise ValueError(f"not an STS task: {task!r}")


def load_binary(senteval_dir: str, task: str) -> LabeledSentences:
  """MR, CR, SUBJ or MPQA: one sentence a line (latin-1); first file label 1, second label 0."""
  check_senteval_dir(senteval_dir)
  folder, first, second = BINARY_FILES[task]
  pos = read_lines(os.path.join(senteval_dir, folder, first), "latin-1")
  neg = read_lines(os.path.join(senteval_dir, folder, second), "latin-1")
  labels = np.asarray([1] * len(pos) + [0] * len(neg), dtype=np.int64)
  return LabeledSentences([normalize(s) for s in pos + neg], labels)


def read_sst_split(path: str) -> LabeledSentences:
  """An SST binary file: `sentence<TAB>label` with label 0 or 1."""
  sentences, labels = [], []
  for lineno, line in enumerate(read_lines(path), start=1):
    sentence, label = _fields(line, path, lineno, 2)
    sentences.append(normalize(sentence))
    labels.append(_label(label, ("0", "1"), path, lineno))
  return LabeledSentences(sentences, np.asarray(labels, dtype=np.int64))


def load_sst2(senteval_dir: str) -> dict[str, LabeledSentences]:
  """SST2 `train`, `dev`, `test` from `SST/binary/sentiment-*`."""
  check_senteval_dir(senteval_dir)
  folder = os.path.join(senteval_dir, "SST", "binary")
  return {split: read_sst_split(os.path.join(folder, f"sentiment-{split}"))
          for split in ("train", "dev", "test")}


def read_trec_split(path: str) -> LabeledSentences:
  """A TREC file (latin-1): `COARSE:fine question`; the six coarse classes are the labels."""
  sentences, labels = [], []
  for lineno, line in enumerate(read_lines(path, "latin-1"), start=1):
    coarse, sep, rest = line.strip().partition(":")
    fine, space, question = rest.partition(" ")
    if not sep or not space or not fine:
      raise SentEvalDataError(f"{path}:{lineno}: expected 'COARSE:fine question', "
                              f"got {line[:40]!r}")
    labels.append(_label(coarse, TREC_LABELS, path, lineno))
    sentences.append(normalize(question))
  return LabeledSentences(sentences, np.asarray(labels, dtype=np.int64))


def load_trec(senteval_dir: str) -> dict[str, LabeledSentences]:
  """TREC `train` (train_5500.label) and `test` (TREC_10.label)."""
  check_senteval_dir(senteval_dir)
  folder = os.path.join(senteval_dir, "TREC")
  return {"train": read_trec_split(os.path.join(folder, "train_5500.label")),
          "test": read_trec_split(os.path.join(folder, "TREC_10.label"))}


def read_mrpc_split(path: str) -> LabeledPairs:
  """An MRPC file: header, then Quality, #1 ID, #2 ID, #1 String, #2 String."""
  lines = read_lines(path, "utf-8-sig")
  first, second, labels = [], [], []
  for lineno, line in enumerate(lines[1:], start=2):
    fields = _fields(line, path, lineno, 5)
    labels.append(_label(fields[0], ("0", "1"), path, lineno))
    first.append(normalize(fields[3]))
    second.append(normalize(fields[4]))
  return LabeledPairs(first, second, np.asarray(labels, dtype=np.int64))


def load_mrpc(senteval_dir: str) -> dict[str, LabeledPairs]:
  """MRPC `train` and `test`."""
  check_senteval_dir(senteval_dir)
  folder = os.path.join(senteval_dir, "MRPC")
  return {split: read_mrpc_split(os.path.join(folder, f"msr_paraphrase_{split}.txt"))
          for split in ("train", "test")}


def load_transfer_task(senteval_dir: str, task: str):
  """`LabeledSentences` (MR/CR/SUBJ/MPQA) or a dict of splits (SST2, TREC, MRPC)."""
  if task in BINARY_FILES:
    return load_binary(senteval_dir, task)
  loaders = {"SST2": load_sst2, "TREC": load_trec, "MRPC": load_mrpc}
  if task not in loaders:
    raise ValueError(f"not a transfer task: {task!r}")
  return loaders[task](senteval_dir)


def load_task(senteval_dir: str, task: str):
  """The data of any of the fourteen tasks (see `load_sts_task`, `load_transfer_task`)."""
  if task in STS7:
    return load_sts_task(senteval_dir, task)
  return load_transfer_task(senteval_dir, task)


def validate_tasks(senteval_dir: str, tasks: Sequence[str]) -> None:
  """Reads every file the tasks need, so that data errors surface before a model is loaded."""
  check_senteval_dir(senteval_dir)
  for task in tasks:
    load_task(senteval_dir, task)


def _find_downstream(root: str) -> str:
  """The extracted folder that holds `STS` and `SICK` (the tar's `downstream/`)."""
  for folder, subdirs, _ in os.walk(root):
    if "STS" in subdirs and "SICK" in subdirs:
      return folder
  raise SentEvalDataError(f"{SENTEVAL_URL}: archive has no folder with STS/ and SICK/")


def download_senteval(dest_dir: str, url: str = SENTEVAL_URL) -> str:
  """Downloads SimCSE's `senteval.tar` and installs its `downstream/` tree as `dest_dir`."""
  if os.path.isdir(dest_dir) and os.listdir(dest_dir):
    raise SentEvalDataError(f"{dest_dir}: exists and is not empty; not downloading over it")
  parent = os.path.dirname(os.path.abspath(dest_dir))
  os.makedirs(parent, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=parent) as tmp:
    archive = os.path.join(tmp, "senteval.tar")
    urllib.request.urlretrieve(url, archive)  # a fixed https URL
    with tarfile.open(archive) as tar:
      tar.extractall(os.path.join(tmp, "x"), filter="data")
    if os.path.isdir(dest_dir):
      os.rmdir(dest_dir)
    shutil.move(_find_downstream(os.path.join(tmp, "x")), dest_dir)
  return dest_dir
