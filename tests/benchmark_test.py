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
  kinds = result["profile"]["ms_per_step_by_kind"]
  assert kinds["matrix multiply"] > 0 and sum(kinds.values()) == pytest.approx(result["profile"]["op_ms_per_step"])
  printed = capsys.readouterr().out
  for text in ("micse_jax step", "PyTorch step", "ratio PyTorch / micse_jax", "separately jitted",
               "online forward+backward", "AMI term", "momentum forward", "optimizer + EMA",
               "XLA op time per step"):
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


def test_trace_summary_sums_op_events_by_kind_without_containers(tmp_path):
  import gzip
  from micse_jax.bench import trace_summary
  run = tmp_path / "plugins" / "profile" / "2026_01_01"
  run.mkdir(parents=True)
  meta = lambda tid, name: {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}}
  op = lambda tid, name, dur: {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": 0, "dur": dur}
  events = [meta(1, "python"), meta(2, "tf_XLAEigen/1"), meta(3, "tf_XLAPjRtCpuClient/2"),
            op(1, "train_step", 99000),               # python thread: not an op
            op(2, "ynn_fusion.3", 3000), op(3, "dot.1", 1000),
            op(2, "multiply_add_fusion.7", 2000), op(3, "custom-call", 500),
            op(2, "while.2", 8000), op(2, "ThunkExecutor::Execute", 9000), op(2, "end: copy", 10),
            op(3, "copy.4", 250), op(3, "wrapped_scatter.1", 250), op(2, "abs", 1000)]
  with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  s = trace_summary.summarize(str(tmp_path), steps=2)
  assert s["ms_per_step_by_kind"] == {"matrix multiply": 2.0, "elementwise fusion": 1.0, "other": 0.5,
                                      "custom call": 0.25, "copy / transpose": 0.125,
                                      "scatter / gather": 0.125}
  assert s["op_ms_per_step"] == 4.0
  assert s["top_ops_ms_per_step"][0] == ("ynn_fusion", 1.5)
