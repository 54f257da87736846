"""`python -m micse_jax.bench` runs end to end on a tiny model and reports what it promises;
its breakdown attributes the full step's op time to the step's named-scope phases."""
import json
import os

import jax
import pytest

from micse_jax.aot import hlo, hlo_module
from micse_jax.bench import __main__ as bench
from micse_jax.bench import jax_step


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache():
  """The trainer's compilation cache (the test session's folder, `conftest.py`): the bench runs and the
  phase test below compile the same tiny step, read back after its first compile."""
  from micse_jax import caches
  from micse_jax.configs import micse
  caches.enable_compilation_cache(micse.get_config())


def test_bench_reports_step_times_ratio_and_breakdown(tmp_path, capsys):
  out = tmp_path / "bench.json"
  result = bench.main(["--model", "tiny", "--batch_size", "4", "--max_length", "16", "--steps", "1", "--rounds", "2",
                       "--warmup", "1", "--piece_steps", "1", "--no-encode", "--torch_mode", "eager",
                       "--output", str(out), "--profile", str(tmp_path / "trace")])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  for side in ("jax", "torch"):
    t = result[side]
    assert t["pipelined_step_ms"] > 0 and t["blocked_step_ms"] > 0 and len(t["pipelined_rounds_ms"]) == 2
    assert min(t["pipelined_rounds_ms"]) <= t["pipelined_step_ms"] <= max(t["pipelined_rounds_ms"])  # their median
    if side == "jax":  # the host's share of a pipelined run: dispatching comes before its one wait
      assert 0 < t["dispatch_step_ms"] <= max(t["pipelined_rounds_ms"])
    assert t["sentences_per_s"] == pytest.approx(4e3 / t["pipelined_step_ms"])  # headline: pipelined
  assert result["speedup_vs_torch"] == result["torch"]["pipelined_step_ms"] / result["jax"]["pipelined_step_ms"]
  assert result["speedup_vs_torch_blocked"] == result["torch"]["blocked_step_ms"] / result["jax"]["blocked_step_ms"]
  assert result["step_flops"] > 0 and result["compile_s"] > 0 and result["model_flops"] > 0
  phases = result["breakdown_ms"]
  for phase in ("encode (forward)", "encode (backward)", "loss/ami (forward)", "momentum_forward", "optimizer"):
    assert phases.get(phase, 0) > 0, phases  # the miCSE step's parts, each found in the profile
  assert "ema" not in phases  # the EMA runs inside the update's one pass (training/update.py)
  assert set(phases) <= {f"{p}{s}" for p in hlo.PHASES for s in ("", " (forward)", " (backward)")} | {
      hlo.NO_PHASE, "(unattributed)"}
  # every op of the profile is in some phase: the phases add up to the op time by kind
  assert sum(phases.values()) == pytest.approx(result["profile"]["op_ms_per_step"], rel=0.02)
  mfu = result["jax"]["mfu"]
  if jax.devices()[0].platform == "cpu":
    assert mfu is None  # no dense peak is known for a CPU
  else:
    assert 0 < mfu < 1
  traces = [f for _, _, files in os.walk(tmp_path / "trace") for f in files if f.endswith(".xplane.pb")]
  assert traces, "--profile writes a jax.profiler trace"
  kinds = result["profile"]["ms_per_step_by_kind"]
  assert kinds["matrix multiply"] > 0 and sum(kinds.values()) == pytest.approx(result["profile"]["op_ms_per_step"])
  printed = capsys.readouterr().out
  for text in ("micse_jax step", "ms pipelined", "ms blocked", "ratios, sentences/s and MFU use the pipelined time",
               "PyTorch (eager, public code) step",
               "ratio PyTorch (eager, public code) / micse_jax", "breakdown by phase",
               "encode (backward)", "loss/ami (forward)", "momentum_forward", "optimizer",
               "XLA op time per step", "model FLOPs/step"):
    assert text in printed


def test_phases_of_the_step_cover_its_compiled_kernels():
  """Every named scope of the miCSE step shows up among the compiled step's kernels, and the
  phase map the breakdown uses names each kernel once."""
  model_dir = jax_step.model_dir_for("tiny")
  step = jax_step.JaxStep(model_dir, jax_step.random_batch(4, 16, 30522, seed=1), "float32")
  step.compile()
  text = step.compiled.as_text()
  module = hlo_module.parse(text)
  phases = hlo.phase_by_instruction(module)
  found_kernels = hlo.kernels(module)
  assert len(phases) == len(found_kernels) == len({k.name for k in found_kernels})
  # a kernel inside a loop of the step (the CPU's rolled RNG rounds) launches once per trip
  assert hlo.summary(module)["kernels_per_step"] == sum(k.runs for k in found_kernels) > len(phases)
  found = set(phases.values())
  for phase in ("encode (forward)", "encode (backward)", "loss/contrastive (forward)", "loss/contrastive (backward)",
                "loss/ami (forward)", "loss/ami (backward)", "momentum_forward", "enqueue", "optimizer"):
    assert phase in found, phase
  assert not found & {"ema", "compute_weights"}  # both inside the update's one pass (training/update.py)
  assert "finite" not in found  # float32: no loss scaling, so no finite check in the program


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


def _write_trace(directory, events):
  import gzip
  run = directory / "plugins" / "profile" / "2026_01_01"
  run.mkdir(parents=True)
  with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_trace_summary_classifies_gpu_kernels_on_the_device_streams_only(tmp_path):
  """A GPU profile: kernels on /device:GPU:0's stream lines, classified by kernel name (cuBLAS,
  cuBLASLt, CUTLASS, Triton GEMMs vs XLA's fusions, copies, NCCL); the host's thunk events and
  the device's derived `XLA Ops` line describe the same work and are not added again."""
  from micse_jax.bench import trace_summary
  process = lambda pid, name: {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
  thread = lambda pid, tid, name: {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
  op = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": 0, "dur": dur}
  gemms = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_kernel": 400,
           "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": 300,
           "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8>": 200,
           "gemm_fusion_dot_general_12": 60, "void gemv2T_kernel_val<int, int, float>": 40}
  events = [process(1, "/host:CPU"), thread(1, 10, "python3"), thread(1, 11, "tf_pjrt_thread/42"),
            process(2, "/device:GPU:0"), thread(2, 20, "Stream #13(Kernel,MemcpyD2D)"),
            thread(2, 21, "Stream #14(MemcpyH2D)"), thread(2, 22, "XLA Ops"), thread(2, 23, "XLA Modules"),
            op(1, 10, "train_step", 9999), op(1, 11, "Thunk:#hlo_op=fusion.3#", 5000),
            op(1, 11, "cuLaunchKernelEx", 700),
            op(2, 22, "fusion.3", 3000), op(2, 23, "jit_train_step(123)", 9000)]
  events += [op(2, 20, name, dur) for name, dur in gemms.items()]
  events += [op(2, 20, "loop_add_fusion_3", 100), op(2, 20, "loop_multiply_fusion", 50),
             op(2, 20, "input_reduce_fusion_1", 80), op(2, 20, "wrapped_transpose_2", 20),
             op(2, 20, "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 30),
             op(2, 20, "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0", 70),
             op(2, 21, "MemcpyH2D", 10), op(2, 20, "loop_gather_fusion", 25), op(2, 20, "rng_state", 15)]
  _write_trace(tmp_path, events)
  s = trace_summary.summarize(str(tmp_path), steps=2)
  assert s["platform"] == "gpu"
  assert s["ms_per_step_by_kind"] == pytest.approx({  # microseconds / 1000 / 2 steps
      "matrix multiply": 1000 / 2e3, "elementwise fusion": 150 / 2e3, "reduce fusion": 80 / 2e3,
      "attention (cuDNN fused)": 70 / 2e3, "collective (NCCL)": 30 / 2e3, "copy / transpose": 30 / 2e3,
      "scatter / gather": 25 / 2e3, "other": 15 / 2e3})
  assert s["op_ms_per_step"] == pytest.approx(1400 / 2e3)
  assert s["top_ops_ms_per_step"][0][1] == pytest.approx(0.2)
  assert s["top_ops_ms_per_step"][0][0].startswith("sm90_xmma_gemm")
  assert "GPU kernel time per step" in trace_summary.report_lines(s)[0]
  # Stream lines named otherwise: every device line but the derived ones is read.
  for e in events:
    if e.get("name") == "thread_name" and e["args"]["name"].startswith("Stream"):
      e["args"]["name"] = e["args"]["name"].replace("Stream #", "CUDA stream ")
  _write_trace(tmp_path / "renamed", events)
  assert trace_summary.summarize(str(tmp_path / "renamed"), steps=2) == s


@pytest.mark.gpu
def test_gpu_profile_puts_most_kernel_time_in_named_kinds(tmp_path):
  """On a GPU the profile summary reads the device's kernels: GEMMs are found (cuBLAS/cuDNN/
  Triton names) and few kernels fall in 'other'."""
  result = bench.main(["--model", "tiny", "--batch_size", "64", "--max_length", "32", "--steps", "2",
                       "--warmup", "1", "--no_breakdown", "--no-encode", "--no_torch",
                       "--profile", str(tmp_path / "trace")])
  s = result["profile"]
  assert s["platform"] == "gpu"
  assert s["ms_per_step_by_kind"]["matrix multiply"] > 0
  assert s["ms_per_step_by_kind"].get("other", 0) < 0.2 * s["op_ms_per_step"], s["top_ops_ms_per_step"]
  phases = s["ms_per_step_by_phase"]  # from the XLA Ops line: op names the phase map knows
  assert phases.get("encode (backward)", 0) > 0 and phases.get("(unattributed)", 0) < 0.2 * sum(phases.values()), phases


def test_bench_keeps_rows_measured_before_a_late_failure(tmp_path, monkeypatch):
  """The PyTorch baseline fails after the micse_jax step was measured: the rows file and the
  output file still hold the compile and step figures."""
  from micse_jax.bench import torch_step

  def broken(*args, **kwargs):
    raise RuntimeError("CUDA out of memory (simulated)")
  monkeypatch.setattr(torch_step, "torch_benchmark", broken)
  rows, output = tmp_path / "rows.jsonl", tmp_path / "out.json"
  with pytest.raises(RuntimeError, match="simulated"):
    bench.main(["--model", "tiny", "--batch_size", "4", "--max_length", "16", "--steps", "1", "--warmup", "1",
                "--rounds", "1", "--no_breakdown", "--no-encode", "--rows", str(rows), "--output", str(output)])
  saved = [json.loads(line) for line in rows.read_text().splitlines()]
  assert [r["row"] for r in saved] == ["setup", "compile", "jax"]
  assert all(r["batch_size"] == 4 and r["dtype"] == "float32" for r in saved)
  assert saved[2]["jax"]["pipelined_step_ms"] > 0 and saved[1]["compile_s"] > 0
  assert json.loads(output.read_text())["jax"] == saved[2]["jax"]
