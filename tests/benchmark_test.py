"""`python -m micse_jax.bench` runs end to end on a tiny model and reports what it promises;
its separately jitted pieces compute the full step's loss and queue update."""
import json
import os

import jax
import numpy as np
import pytest

from micse_jax.bench import __main__ as bench
from micse_jax.bench import jax_step


def test_bench_reports_step_times_ratio_and_breakdown(tmp_path, capsys):
  out = tmp_path / "bench.json"
  result = bench.main(["--model", "tiny", "--batch_size", "4", "--max_length", "16", "--steps", "1",
                       "--warmup", "1", "--piece_steps", "1", "--no-encode", "--output", str(out),
                       "--profile", str(tmp_path / "trace")])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  for side in ("jax", "torch"):
    assert result[side]["step_ms"] > 0 and result[side]["sentences_per_s"] > 0
  assert result["speedup_vs_torch"] == result["torch"]["step_ms"] / result["jax"]["step_ms"]
  assert result["step_flops"] > 0 and result["compile_s"] > 0
  assert set(result["breakdown_ms"]) == set(bench.PIECES)
  assert all(ms > 0 for ms in result["breakdown_ms"].values())
  assert result["jax"]["mfu"] is None if jax.devices()[0].platform == "cpu" else True
  traces = [f for _, _, files in os.walk(tmp_path / "trace") for f in files if f.endswith(".xplane.pb")]
  assert traces, "--profile writes a jax.profiler trace"
  printed = capsys.readouterr().out
  for text in ("micse_jax step", "PyTorch step", "ratio PyTorch / micse_jax", "separately jitted",
               "online forward+backward", "AMI term", "momentum forward", "optimizer + EMA"):
    assert text in printed


def test_breakdown_pieces_compute_the_full_step(tmp_path):
  model_dir = jax_step.model_dir_for("tiny")
  batch = jax_step.random_batch(4, 16, 30522, seed=1)
  step = jax_step.JaxStep(model_dir, batch, "float32")
  pieces = step.pieces()
  infonce, _, grads = pieces["online_fwd_bwd"]()
  ami, att_grads = pieces["ami"]()
  queue, valid, ptr = pieces["momentum_fwd"]()
  params, _, ema = pieces["optimizer_ema"]()
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((grads, att_grads, params, ema)))
  step.compile()
  metrics = jax.device_get(step.run_step())
  assert float(infonce) + float(ami) == pytest.approx(float(metrics["loss"]), rel=1e-5)
  assert float(infonce) == pytest.approx(float(metrics["infonce"]), rel=1e-5)
  np.testing.assert_allclose(np.asarray(step.state.queue), np.asarray(queue), atol=1e-5)
  assert int(step.state.queue_ptr) == int(ptr) == 4 and int(np.asarray(valid).sum()) == 4


def test_encode_comparison_agrees_with_sentence_transformers():
  from micse_jax.bench import encode
  sentences, source = encode.sentences_for_benchmark(24, corpus=None)
  assert source == "random words" and len(set(sentences)) == 24
  result = encode.encode_benchmark(jax_step.model_dir_for("tiny"), sentences, batch_size=8, max_length=64)
  assert result["micse_jax_sentences_per_s"] > 0 and result["sentence_transformers_sentences_per_s"] > 0
  assert result["mean_cosine_between_the_two"] > 0.999  # the same embeddings, independently computed
