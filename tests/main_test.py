"""One command, end to end: `python -m micse_jax.main` trains a tiny model for a few steps with
STS-B dev selection, writes every workdir artefact, and the result evaluates and exports."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from tests.train_utils import tiny_training_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stsb_dev_reference(encode, senteval_dir):
  """STS-B dev Spearman ×100 computed here from the raw file (independent of the evaluator)."""
  path = os.path.join(senteval_dir, "STS", "STSBenchmark", "sts-dev.csv")
  gold, s1, s2 = [], [], []
  with open(path, encoding="utf-8") as f:
    for line in f:
      cols = line.rstrip("\n").split("\t")
      gold.append(float(cols[4]))
      s1.append(cols[5])
      s2.append(cols[6])
  a, b = encode(s1), encode(s2)
  cos = np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
  return 100 * stats.spearmanr(cos, gold).correlation


def test_main_trains_selects_evaluates_and_exports(tmp_path, minilm_dir, senteval_dir):
  config = tiny_training_config(tmp_path, minilm_dir)
  workdir = tmp_path / "wd"
  overrides = {"model.name_or_path": config.model.name_or_path, "data.corpus": config.data.corpus,
               "batch_size": 8, "num_train_steps": 4, "eval_every": 2, "checkpoint_every": 2,
               "model.max_length": 16, "momentum.queue_size": 12, "ami.layers": "(0,1)",
               "ami.num_samples": 20, "eval.senteval_dir": senteval_dir,
               "eval.final_tasks": "STSBenchmark", "log_every": 1}
  cmd = [sys.executable, "-m", "micse_jax.main", "--config", "configs/micse.py", "--workdir", str(workdir),
         *[f"--config.{k}={v}" for k, v in overrides.items()]]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]

  run_config = json.loads((workdir / "config.json").read_text())
  assert run_config["batch_size"] == 8 and run_config["bert_config"]["hidden_size"] == 64
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
  assert any(f.startswith("events") for f in os.listdir(workdir / "tensorboard"))
  results = json.loads((workdir / "results.json").read_text())
  assert "STS-B" in out.stdout  # the Markdown table

  from micse_jax import workdir as workdir_lib
  from micse_jax.encoder import load_encoder
  best = workdir_lib.best_manager(str(workdir), read_only=True)
  best_step = best.best_step()
  assert best_step in (2, 4)
  encoder = load_encoder(str(workdir), "best")
  encode = lambda s: encoder.encode(s, "cls_before_pooler", batch_size=128)
  dev = _stsb_dev_reference(encode, senteval_dir)  # the selection metric, recomputed
  assert dev == pytest.approx(best.metrics(best_step)["stsb_dev"], abs=0.05)
  test_spearman = results["sts"]["tasks"]["STSBenchmark"]["spearman"]
  assert np.isfinite(test_spearman) and results["settings"]["checkpoint"].startswith("best")

  export = tmp_path / "export"
  conv = subprocess.run([sys.executable, "-m", "micse_jax.convert", "--workdir", str(workdir), "--best",
                         "--output", str(export)], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert conv.returncode == 0, conv.stderr[-2000:]
  import torch
  import transformers
  hf = transformers.AutoModel.from_pretrained(str(export)).eval()
  tok = transformers.AutoTokenizer.from_pretrained(str(export))
  sentences = ["A man is playing a guitar.", "Two dogs run in the park."]
  with torch.no_grad():
    cls = hf(**tok(sentences, padding=True, return_tensors="pt")).last_hidden_state[:, 0].numpy()
  np.testing.assert_allclose(encode(sentences), cls, atol=1e-4)
