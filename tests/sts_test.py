"""STS protocol: cosine + Spearman x100 against an independent scipy computation, all/wmean/mean."""
import hashlib
import os

import numpy as np
import pytest
from scipy import stats

from micse_jax.evaluation import sts
from micse_jax.evaluation.senteval_data import STS_YEARS

DIM = 64


def bag_of_words(sentences):
  """Deterministic hashing bag-of-words encoder (a stand-in for a model)."""
  out = np.zeros((len(sentences), DIM), np.float32)
  for row, sentence in enumerate(sentences):
    for token in sentence.lower().split():
      digest = hashlib.md5(token.encode("utf-8")).digest()
      out[row, digest[0] % DIM] += 1.0 if digest[1] % 2 else -1.0
  return out


class CountingEncoder:
  """Records every call; embeds with `bag_of_words`."""

  def __init__(self):
    self.calls = []

  def __call__(self, sentences):
    self.calls.append(list(sentences))
    return bag_of_words(sentences)


def _independent_pairs(path_input, path_gold):
  """Own reading of an STS subset: (sentence1, sentence2, gold) with scored pairs only."""
  with open(path_input, encoding="utf-8") as f:
    pairs = [line.rstrip("\n").split("\t") for line in f]
  with open(path_gold, encoding="utf-8") as f:
    golds = [line.strip() for line in f]
  return [(" ".join(a.split()), " ".join(b.split()), float(g))
          for (a, b), g in zip(pairs, golds) if g]


def _independent_spearman(rows):
  a = bag_of_words([r[0] for r in rows]).astype(np.float64)
  b = bag_of_words([r[1] for r in rows]).astype(np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    cos = np.nan_to_num((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))
  return 100 * stats.spearmanr(cos, [r[2] for r in rows])[0]


def test_sts_year_matches_independent_scipy(senteval_dir):
  encoder = CountingEncoder()
  result = sts.evaluate_sts(encoder, senteval_dir, ["STS12"])["tasks"]["STS12"]
  folder, subsets = STS_YEARS["STS12"]
  folder = os.path.join(senteval_dir, "STS", folder)
  rows = {s: _independent_pairs(os.path.join(folder, f"STS.input.{s}.txt"),
                                os.path.join(folder, f"STS.gs.{s}.txt")) for s in subsets}
  everything = [r for s in subsets for r in rows[s]]
  assert result["spearman"] == pytest.approx(_independent_spearman(everything), abs=1e-9)
  assert result["n"] == len(everything) == 3108
  per_subset = {s: _independent_spearman(rows[s]) for s in subsets}
  for s in subsets:
    assert result["subsets"][s]["spearman"] == pytest.approx(per_subset[s], abs=1e-9)
  sizes = np.array([len(rows[s]) for s in subsets])
  values = np.array([per_subset[s] for s in subsets])
  assert result["wmean"] == pytest.approx(float((values * sizes).sum() / sizes.sum()), abs=1e-9)
  assert result["mean"] == pytest.approx(float(values.mean()), abs=1e-9)
  assert len(encoder.calls) == 1  # one call, each unique sentence once
  assert len(encoder.calls[0]) == len(set(encoder.calls[0]))
  assert set(encoder.calls[0]) == {s for r in everything for s in r[:2]}


def test_stsb_and_sickr_test_match_independent_scipy(senteval_dir):
  result = sts.evaluate_sts(bag_of_words, senteval_dir, ["STSBenchmark", "SICKRelatedness"])
  with open(os.path.join(senteval_dir, "STS", "STSBenchmark", "sts-test.csv"),
            encoding="utf-8") as f:
    fields = [line.rstrip("\n").split("\t") for line in f]
  stsb = [(" ".join(x[5].split()), " ".join(x[6].split()), float(x[4])) for x in fields]
  with open(os.path.join(senteval_dir, "SICK", "SICK_test_annotated.txt"), encoding="utf-8") as f:
    fields = [line.rstrip("\r\n").split("\t") for line in f][1:]
  sick = [(" ".join(x[1].split()), " ".join(x[2].split()), float(x[3])) for x in fields]
  tasks = result["tasks"]
  assert tasks["STSBenchmark"]["spearman"] == pytest.approx(_independent_spearman(stsb), abs=1e-9)
  assert tasks["SICKRelatedness"]["spearman"] == pytest.approx(_independent_spearman(sick),
                                                               abs=1e-9)
  assert (tasks["STSBenchmark"]["n"], tasks["SICKRelatedness"]["n"]) == (1379, 4927)
  assert result["avg"] == pytest.approx(
      (tasks["STSBenchmark"]["spearman"] + tasks["SICKRelatedness"]["spearman"]) / 2)


def test_dev_metrics(senteval_dir):
  stsb_dev = sts.stsb_dev_spearman(bag_of_words, senteval_dir)
  sickr_dev = sts.sickr_dev_spearman(bag_of_words, senteval_dir)
  with open(os.path.join(senteval_dir, "STS", "STSBenchmark", "sts-dev.csv"),
            encoding="utf-8") as f:
    fields = [line.rstrip("\n").split("\t") for line in f]
  rows = [(" ".join(x[5].split()), " ".join(x[6].split()), float(x[4])) for x in fields]
  assert stsb_dev == pytest.approx(_independent_spearman(rows), abs=1e-9)
  assert -100 <= sickr_dev <= 100 and sickr_dev != pytest.approx(stsb_dev)


# Tiny STS13: cosine predictions and gold designed for hand-computed Spearman values.
#   FNWN      pred .1 .2 .3   gold 1 2 3     -> rho = +1   (plus one unscored pair, skipped)
#   headlines pred .4 .5      gold 2.5 .5    -> rho = -1
#   OnWN      pred .6 .7      gold 4 5       -> rho = +1
# all: pred ranks 1..7, gold ranks [2,3,5,4,1,6,7], sum d^2 = 1+1+4+0+16 = 22,
#      rho = 1 - 6*22 / (7*48) = 0.607142857...
# wmean = (3*1 - 2*1 + 2*1) / 7 = 3/7; mean = (1 - 1 + 1) / 3 = 1/3.
TINY = {"FNWN": ([0.1, 0.2, 0.3, 0.9], ["1", "2", "3", ""]),
        "headlines": ([0.4, 0.5], ["2.5", "0.5"]),
        "OnWN": ([0.6, 0.7], ["4", "5"])}


def _tiny_sts13(root):
  folder = os.path.join(root, "STS", "STS13-en-test")
  os.makedirs(folder)
  vectors = {}
  for subset, (preds, golds) in TINY.items():
    lines = []
    for i, cos in enumerate(preds):
      first, second = f"{subset} left {i}", f"{subset} right {i}"
      vectors[first] = [1.0, 0.0]
      vectors[second] = [cos, np.sqrt(1 - cos ** 2)]
      lines.append(f"{first}\t{second}\n")
    with open(os.path.join(folder, f"STS.input.{subset}.txt"), "w") as f:
      f.writelines(lines)
    with open(os.path.join(folder, f"STS.gs.{subset}.txt"), "w") as f:
      f.write("\n".join(golds) + "\n")
  return lambda sentences: np.array([vectors[s] for s in sentences], np.float32)


def test_all_wmean_mean_hand_computed(tmp_path):
  encode = _tiny_sts13(str(tmp_path))
  result = sts.evaluate_sts(encode, str(tmp_path), ["STS13"])["tasks"]["STS13"]
  assert result["all"] == result["spearman"] == pytest.approx(100 * (1 - 6 * 22 / (7 * 48)))
  assert result["wmean"] == pytest.approx(100 * 3 / 7)
  assert result["mean"] == pytest.approx(100 / 3)
  assert {k: v["spearman"] for k, v in result["subsets"].items()} == pytest.approx(
      {"FNWN": 100.0, "headlines": -100.0, "OnWN": 100.0})
  assert result["n"] == 7


def test_zero_vector_gives_zero_cosine():
  a = np.array([[0.0, 0.0], [1.0, 0.0]])
  b = np.array([[1.0, 0.0], [1.0, 1.0]])
  np.testing.assert_allclose(sts.cosine_rows(a, b), [0.0, np.sqrt(0.5)])


def test_bad_encoder_output_shape(tmp_path):
  _tiny_sts13(str(tmp_path))
  with pytest.raises(ValueError, match="expected \\[n, dim\\]"):
    sts.evaluate_sts(lambda s: np.zeros(len(s)), str(tmp_path), ["STS13"])
  with pytest.raises(ValueError, match="not an STS task"):
    sts.evaluate_sts(bag_of_words, str(tmp_path), ["MR"])
