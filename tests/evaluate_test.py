"""The evaluation CLI and report, plus STS parity of the JAX encoder with transformers + torch."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from micse_jax.evaluation import report, runner
from micse_jax.evaluation.senteval_data import STS_YEARS, SentEvalDataError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YEAR, YEAR_LINES = "STS13", 60  # 3 subsets, all pairs scored -> 180 pairs
STSB_PAIRS = 200


def _write(path, lines):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write("".join(lines))


def _tiny_sts13(root, broken=False):
  """STS13 with two pairs per subset; `broken` puts a one-column line into FNWN."""
  folder = os.path.join(root, "STS", "STS13-en-test")
  for subset in STS_YEARS["STS13"][1]:
    first = "a man plays\tthe man plays\n"
    _write(os.path.join(folder, f"STS.input.{subset}.txt"),
           [first, "no tab here\n" if broken and subset == "FNWN" else "a dog\tcats sleep\n"])
    _write(os.path.join(folder, f"STS.gs.{subset}.txt"), ["4.5\n", "0.5\n"])
  return root


def _cli(*args, cwd=REPO):
  env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  return subprocess.run([sys.executable, "-m", "micse_jax.evaluate", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300, check=False)


def _assert_one_line_error(proc, *fragments):
  assert proc.returncode != 0
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


# ------------------------------------------------------------------ CLI errors

@pytest.mark.parametrize("flags,fragments", [
    (["--tasks", "STS13,STS17"], ["unknown task 'STS17'"]),
    (["--pooler", "max"], ["unknown pooler 'max'", "cls_before_pooler"]),
    (["--checkpoint", "newest"], ["--checkpoint must be"]),
])
def test_cli_rejects_bad_flags(tmp_path, flags, fragments):
  data = _tiny_sts13(str(tmp_path / "senteval"))
  output = tmp_path / "out.json"
  proc = _cli("--model", str(tmp_path), "--senteval_dir", data, "--tasks", "STS13",
              "--output", str(output), *flags)
  _assert_one_line_error(proc, *fragments)
  assert not output.exists()


def test_cli_missing_senteval_dir(tmp_path):
  output = tmp_path / "out.json"
  proc = _cli("--model", str(tmp_path), "--senteval_dir", str(tmp_path / "none"),
              "--output", str(output))
  _assert_one_line_error(proc, "SentEval data directory not found", "senteval.tar")
  assert not output.exists()


def test_cli_malformed_file(tmp_path):
  data = _tiny_sts13(str(tmp_path / "senteval"), broken=True)
  output = tmp_path / "out.json"
  proc = _cli("--model", str(tmp_path), "--senteval_dir", data, "--tasks", "STS13",
              "--output", str(output))
  _assert_one_line_error(proc, "STS.input.FNWN.txt:2:", "expected 2 tab-separated fields")
  assert not output.exists()


def test_cli_missing_model(tmp_path):
  data = _tiny_sts13(str(tmp_path / "senteval"))
  output = tmp_path / "out.json"
  proc = _cli("--model", str(tmp_path / "no_model"), "--senteval_dir", data, "--tasks", "STS13",
              "--output", str(output))
  _assert_one_line_error(proc, "model path not found", "no_model")
  assert not output.exists()
  (tmp_path / "not_a_model").mkdir()
  proc = _cli("--model", str(tmp_path / "not_a_model"), "--senteval_dir", data, "--tasks",
              "STS13", "--output", str(output))
  _assert_one_line_error(proc, "no config.json", "not_a_model")
  assert not output.exists()
  _assert_one_line_error(_cli("--senteval_dir", data, "--tasks", "STS13"), "--model is required")
  _assert_one_line_error(_cli("--model", str(tmp_path), "extra"), "unexpected arguments: extra")


def test_cli_output_folder_must_exist(tmp_path):
  data = _tiny_sts13(str(tmp_path / "senteval"))
  proc = _cli("--model", str(tmp_path), "--senteval_dir", data, "--tasks", "STS13",
              "--output", str(tmp_path / "missing" / "out.json"))
  _assert_one_line_error(proc, "output folder does not exist")


# ------------------------------------------------------------------ run_evaluation and report

def _hash_encoder(sentences):
  out = np.zeros((len(sentences), 16), np.float32)
  for row, sentence in enumerate(sentences):
    for token in sentence.split():
      out[row, sum(map(ord, token)) % 16] += 1
  return out


def test_run_evaluation_and_report(tmp_path):
  data = _tiny_sts13(str(tmp_path / "senteval"))
  results = runner.run_evaluation(_hash_encoder, data, "STS13")
  assert set(results) == {"settings", "sts", "elapsed_seconds"}
  assert list(results["sts"]["tasks"]) == ["STS13"]
  assert results["sts"]["avg"] == results["sts"]["tasks"]["STS13"]["spearman"]
  assert results["settings"]["tasks"] == ["STS13"]
  with pytest.raises(SentEvalDataError):
    runner.run_evaluation(_hash_encoder, data, "STS12")
  document = report.build_report(results, model="m", pooler="avg",
                                 settings=results["settings"], elapsed_seconds=1.5)
  path = tmp_path / "results.json"
  report.write_json(str(path), document)
  loaded = json.loads(path.read_text())
  assert loaded["model"] == "m" and loaded["pooler"] == "avg" and loaded["elapsed_seconds"] == 1.5
  assert loaded["sts"]["tasks"]["STS13"]["n"] == 6
  assert os.listdir(tmp_path) == ["senteval", "results.json"] or \
      sorted(os.listdir(tmp_path)) == ["results.json", "senteval"]


def test_write_json_is_atomic(tmp_path, monkeypatch):
  path = tmp_path / "r.json"
  report.write_json(str(path), {"a": np.float32(1.5), "b": np.arange(2), "c": float("nan")})
  assert json.loads(path.read_text()) == {"a": 1.5, "b": [0, 1], "c": None}

  def failing_replace(src, dst):
    raise OSError("disk full")

  monkeypatch.setattr(os, "replace", failing_replace)
  with pytest.raises(OSError):
    report.write_json(str(path), {"a": 2})
  assert json.loads(path.read_text())["a"] == 1.5  # old file untouched
  assert os.listdir(tmp_path) == ["r.json"]  # no temporary left behind


def test_markdown_table_column_order():
  results = {"sts": {"tasks": {"SICKRelatedness": {"spearman": 77.154},
                               "STS12": {"spearman": 72.371}}, "avg": 74.76},
             "transfer": {"tasks": {"MRPC": {"acc": 70.0}, "MR": {"acc": 80.0}}, "avg": 75.0}}
  text = report.markdown_table(results)
  assert "| STS12 | STS13 | STS14 | STS15 | STS16 | STS-B | SICK-R | Avg. |" in text
  assert "| 72.37 | - | - | - | - | - | 77.15 | 74.76 |" in text
  assert "| MR | CR | SUBJ | MPQA | SST2 | TREC | MRPC | Avg. |" in text
  assert "| 80.00 | - | - | - | - | - | 70.00 | 75.00 |" in text


# ------------------------------------------------------------------ real model parity

def _subset_dir(senteval_dir, root):
  """STS-B (first 300 test pairs) and STS13 (first 100 pairs of each subset) in a temp dir."""
  src = os.path.join(senteval_dir, "STS", "STSBenchmark")
  for split in ("train", "dev", "test"):
    with open(os.path.join(src, f"sts-{split}.csv"), encoding="utf-8") as f:
      lines = f.readlines()[:STSB_PAIRS if split == "test" else 5]
    _write(os.path.join(root, "STS", "STSBenchmark", f"sts-{split}.csv"), lines)
  folder, subsets = STS_YEARS[YEAR]
  for subset in subsets:
    for kind in ("input", "gs"):
      name = f"STS.{kind}.{subset}.txt"
      with open(os.path.join(senteval_dir, "STS", folder, name), encoding="utf-8") as f:
        _write(os.path.join(root, "STS", folder, name), f.readlines()[:YEAR_LINES])
  return root


def _reference_pairs(root):
  """Independent reading: {task: (sentences1, sentences2, gold)} of the subset dir."""
  with open(os.path.join(root, "STS", "STSBenchmark", "sts-test.csv"), encoding="utf-8") as f:
    rows = [line.rstrip("\n").split("\t") for line in f]
  pairs = {"STSBenchmark": [(r[5], r[6], float(r[4])) for r in rows]}
  folder, subsets = STS_YEARS[YEAR]
  year = []
  for subset in subsets:
    base = os.path.join(root, "STS", folder)
    with open(os.path.join(base, f"STS.input.{subset}.txt"), encoding="utf-8") as f:
      inputs = [line.rstrip("\n").split("\t") for line in f]
    with open(os.path.join(base, f"STS.gs.{subset}.txt"), encoding="utf-8") as f:
      golds = [line.strip() for line in f]
    year += [(a, b, float(g)) for (a, b), g in zip(inputs, golds) if g]
  pairs[YEAR] = year
  clean = lambda s: " ".join(s.split())
  return {task: ([clean(a) for a, _, _ in rows], [clean(b) for _, b, _ in rows],
                 np.array([g for _, _, g in rows])) for task, rows in pairs.items()}


def _torch_embeddings(model_dir, sentences, max_length=128):
  """transformers + torch: {'avg': ..., 'cls_before_pooler': ...} for `sentences`."""
  import torch
  from transformers import AutoModel, AutoTokenizer
  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  model = AutoModel.from_pretrained(model_dir).eval()
  out = {"avg": [], "cls_before_pooler": []}
  with torch.no_grad():
    for start in range(0, len(sentences), 64):
      batch = tokenizer(sentences[start:start + 64], padding=True, truncation=True,
                        max_length=max_length, return_tensors="pt")
      hidden = model(**batch).last_hidden_state
      mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
      out["avg"].append(((hidden * mask).sum(1) / mask.sum(1)).numpy())
      out["cls_before_pooler"].append(hidden[:, 0].numpy())
  return {k: np.concatenate(v).astype(np.float64) for k, v in out.items()}


def _spearman(e1, e2, gold):
  cos = (e1 * e2).sum(1) / (np.linalg.norm(e1, axis=1) * np.linalg.norm(e2, axis=1))
  return 100 * stats.spearmanr(cos, gold)[0]


@pytest.mark.slow  # ~50 s: the whole STS-B dev on MiniLM; the forward is torch-checked in bert_test, the scoring in sts tests
def test_sts_parity_with_transformers(senteval_dir, minilm_dir, tmp_path):
  from micse_jax.encoder import SentenceEncoder
  root = _subset_dir(senteval_dir, str(tmp_path))
  pairs = _reference_pairs(root)
  sentences = sorted({s for a, b, _ in pairs.values() for s in a + b})
  reference = _torch_embeddings(minilm_dir, sentences)
  row = {s: i for i, s in enumerate(sentences)}
  encoder = SentenceEncoder.from_pretrained(minilm_dir)
  for pooler in ("avg", "cls_before_pooler"):
    encode = lambda s, p=pooler: encoder.encode(s, pooler=p, batch_size=64, max_length=128)
    ours = runner.run_evaluation(encode, root, f"{YEAR},STS-B")["sts"]["tasks"]
    for task, (first, second, gold) in pairs.items():
      emb = reference[pooler]
      expected = _spearman(emb[[row[s] for s in first]], emb[[row[s] for s in second]], gold)
      assert ours[task]["n"] == len(gold)
      assert ours[task]["spearman"] == pytest.approx(expected, abs=0.05), (pooler, task)
  assert len(pairs["STSBenchmark"][2]) == STSB_PAIRS and len(pairs[YEAR][2]) == 3 * YEAR_LINES


def test_cli_end_to_end_with_real_model(senteval_dir, minilm_dir, tmp_path):
  root = _subset_dir(senteval_dir, str(tmp_path / "senteval"))
  output = tmp_path / "results.json"
  proc = _cli("--model", minilm_dir, "--senteval_dir", root, "--tasks", "STS-B",
              "--pooler", "avg", "--max_length", "128", "--output", str(output))
  assert proc.returncode == 0, proc.stderr[-2000:]
  document = json.loads(output.read_text())
  assert document["model"] == minilm_dir and document["pooler"] == "avg"
  assert document["settings"]["max_length"] == 128 and document["elapsed_seconds"] > 0
  spearman = document["sts"]["tasks"]["STSBenchmark"]["spearman"]
  assert 70 < spearman < 95
  assert f"{spearman:.2f}" in proc.stdout and "| STS12 | STS13 |" in proc.stdout
