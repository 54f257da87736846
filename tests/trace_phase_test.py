"""GPU kernel time by phase of the step (`bench/trace_summary.py`): kernel events mapped through
their own HLO instruction, or aligned with the program when a CUDA graph launched them, on a
hand-written trace in the event format of a real jax.profiler GPU trace; and on the H200 traces
when they are here."""
import gzip
import json
import os

import pytest

from micse_jax.bench import trace_summary

# The program's kernel-launching instructions in program order, with their phases (what
# aot/hlo.phase_by_instruction gives).
PHASES = {"copy.5": "(no phase)", "loop_add_fusion.3": "encode (forward)", "custom-call.2": "encode (forward)",
          "loop_add_fusion.7": "encode (backward)", "gemm_fusion_dot.4": "encode (backward)",
          "custom-call.9": "optimizer", "input_reduce_fusion.9": "optimizer"}


def _kernel(name, ts, dur, correlation, hlo_op="command_buffer_1"):
  return {"ph": "X", "pid": 1, "tid": 14, "ts": ts, "dur": dur, "name": name,
          "args": {"context_id": "$$1", "correlation_id": str(correlation), "cuda_graph_id": "197",
                   "hlo_module": "jit_train_step", "hlo_op": hlo_op, "tf_op": "XlaModule:",
                   "kernel_details": "regs:16 static_shared:0 dynamic_shared:0 grid:1,1,1 block:256,1,1"}}


def _step(correlation, t0):
  """One launch of the step's CUDA graph: (name, duration in us) in launch order."""
  events = [("memcpy32_post", 1.0),                                     # copy.5
            ("loop_add_fusion_3", 10.0),                                # loop_add_fusion.3
            ("Memset 0", 0.5), ("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT", 40.0),  # custom-call.2
            ("loop_add_fusion_3", 12.0),                                # loop_add_fusion.7: the same kernel, reused
            ("gemm_fusion_dot_4", 30.0),                                # gemm_fusion_dot.4
            ("Memset 0", 0.5), ("nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_splitK_NTN", 20.0),  # custom-call.9,
            ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", 4.0),   # split-K: 2 kernels
            ("input_reduce_fusion_9", 8.0)]                             # input_reduce_fusion.9
  found, ts = [], t0
  for name, dur in events:
    found.append(_kernel(name, ts, dur, correlation))
    ts += dur + 0.2
  return found


def _trace(tmp_path, extra=()):
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 1, "tid": 14, "name": "thread_name", "args": {"name": "Stream #14(Memset,Compute)"}},
          {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 701, "tid": 9, "name": "thread_name", "args": {"name": "python3"}},
          {"ph": "X", "pid": 701, "tid": 9, "ts": 0, "dur": 500, "name": "command_buffer_1", "args": {}}]
  run = tmp_path / "plugins" / "profile" / "2026_11_26"
  run.mkdir(parents=True)
  with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"displayTimeUnit": "ns", "traceEvents": meta + _step(1, 1000) + _step(2, 2000) + list(extra)}, f)
  return trace_summary.trace_file(str(tmp_path))


def test_command_buffer_events_are_aligned_with_the_program():
  names = [e["name"] for e in _step(1, 0)]
  assert trace_summary.align(names, list(PHASES)) == [0, 1, 2, 2, 3, 4, 5, 5, 5, 6]


def test_phase_time_of_a_gpu_trace(tmp_path):
  path = _trace(tmp_path)
  by_phase = trace_summary.phase_durations(path, PHASES)
  # two steps; hand-added per phase: (no phase) 1, forward 10 + 0.5 + 40, backward 12 + 30, optimizer 0.5+20+4+8
  assert by_phase == {"(no phase)": 2.0, "encode (forward)": 101.0, "encode (backward)": 84.0, "optimizer": 65.0}
  durations, unattributed = trace_summary.kernel_durations(path, list(PHASES))
  assert durations["loop_add_fusion.7"] == 24.0 and durations["custom-call.9"] == 49.0 and unattributed == 0


def test_events_naming_their_instruction_map_directly_and_strangers_stay_unattributed(tmp_path):
  extra = [_kernel("some_kernel_3", 5000, 7.0, 3, hlo_op="gemm_fusion_dot.4"),   # no command buffer
           _kernel("loop_multiply_fusion_2", 6000, 5.0, 4, hlo_op="command_buffer_2")]  # of no instruction
  path = _trace(tmp_path, extra)
  by_phase = trace_summary.phase_durations(path, PHASES)
  assert by_phase["encode (backward)"] == 84.0 + 7.0
  assert by_phase["(unattributed)"] == 5.0
  s = trace_summary.summarize(str(tmp_path), steps=2, phases=PHASES)
  assert s["attributed_share"] == pytest.approx(1 - 5.0 / (252.0 + 12.0))


CALIBRATION = os.environ.get("MICSE_GPU_CALIBRATION_DIR", "/work/calib/h200-c57458b")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["b50", "b512", "k5"])
def test_real_h200_traces_put_90_percent_of_kernel_time_in_phases(point):
  """The H200's own traces and programs (not in the repository; MICSE_GPU_CALIBRATION_DIR)."""
  hlo, trace = (os.path.join(CALIBRATION, f"{point}.{x}") for x in ("hlo.txt.gz", "trace.json.gz"))
  if not (os.path.exists(hlo) and os.path.exists(trace)):
    pytest.skip(f"no GPU calibration point {point} under {CALIBRATION}")
  from micse_jax.aot import hlo as hlo_kernels
  from micse_jax.aot import hlo_module, time_model
  phases = hlo_kernels.phase_by_instruction(hlo_module.parse(time_model.read_hlo(hlo)))
  by_phase = trace_summary.phase_durations(trace, phases)
  assert by_phase["(unattributed)"] < 0.1 * sum(by_phase.values()), by_phase
  assert by_phase["encode (backward)"] > 0 and by_phase["optimizer"] > 0


# A step split into CUDA graphs by the library calls launched between them (`mesh.cuda_graphs=kernels`):
# every fusion kernel has the same name stem (XLA names a shared kernel after one of its
# instructions), so only the calls between the graphs say which layer's instructions a graph holds.
SPLIT_PHASES = {"fusion.1": "encode (forward)", "custom-call.1": "encode (forward)", "fusion.2": "encode (forward)",
                "fusion.3": "encode (backward)", "custom-call.2": "encode (backward)", "fusion.4": "encode (backward)",
                "fusion.5": "optimizer"}


def _split_step(step: int, t0: float) -> list[dict]:
  """One step: graph 1 (fusion.1), cuBLAS (custom-call.1), graph 7 (fusion.2, fusion.3), cuBLAS
  (custom-call.2), graph 9 (fusion.4, fusion.5); durations 1, 10, 2, 3, 20, 4, 5 us."""
  launches = [("command_buffer_1", [("fusion_1", 1.0)]), ("custom-call.1", [("nvjet_sm90_tst_a_NNT", 10.0)]),
              ("command_buffer_7", [("fusion_9", 2.0), ("fusion_3", 3.0)]),
              ("custom-call.2", [("nvjet_sm90_tst_b_TNT", 20.0)]),
              ("command_buffer_9", [("fusion_9", 4.0), ("fusion_5", 5.0)])]
  found, ts = [], t0
  for i, (hlo_op, kernels) in enumerate(launches):
    for name, dur in kernels:
      found.append(_kernel(name, ts, dur, 10 * step + i, hlo_op=hlo_op))
      ts += dur + 0.2
  return found


def test_graphs_between_library_calls_take_the_instructions_between_those_calls(tmp_path):
  run = tmp_path / "plugins" / "profile" / "2026_11_28"
  run.mkdir(parents=True)
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 1, "tid": 14, "name": "thread_name", "args": {"name": "Stream #14(Compute,Memset)"}}]
  with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": meta + _split_step(1, 1000) + _split_step(2, 2000)}, f)
  durations, unattributed = trace_summary.kernel_durations(trace_summary.trace_file(str(tmp_path)), list(SPLIT_PHASES))
  assert unattributed == 0
  assert dict(durations) == {"fusion.1": 2.0, "custom-call.1": 20.0, "fusion.2": 4.0, "fusion.3": 6.0,
                             "custom-call.2": 40.0, "fusion.4": 8.0, "fusion.5": 10.0}
  s = trace_summary.summarize(str(tmp_path), steps=2, phases=SPLIT_PHASES)
  assert s["ms_per_step_by_phase"] == pytest.approx({"encode (forward)": 0.013, "encode (backward)": 0.027,
                                                     "optimizer": 0.005})
  assert s["attributed_share"] == 1.0
