"""The time model of a compiled program (`micse_jax/aot`) on hand-written HLO: each kernel's bytes,
FLOPs and threefry hashes, and its time, against values computed by hand here from the targets'
published peaks and the model's constants as docs/AOT.md gives them, written below as numbers: a
change of the model's constants or formulas fails these tests."""
import gzip
import json
import os

import pytest

from micse_jax.aot import hlo, host, kernel_cost, time_model
from micse_jax.aot.hlo_module import parse

H100 = time_model.DEVICES["h100"]
# The targets' peaks (NVIDIA datasheets, SXM parts, dense; Google Cloud TPU pages): bytes/s, FLOP/s.
H100_BANDWIDTH, H200_BANDWIDTH, H100_BF16 = 3.35e12, 4.8e12, 989.4e12
H100_INT32_OPS = 132 * 64 * 1.98e9  # 132 SMs x 64 INT32 lanes x 1.98 GHz boost
TPU_V5E_BANDWIDTH, TPU_V5E_BF16 = 0.819e12, 197e12
# The time model's constants (docs/AOT.md, "The time model"): fitted to the H200 calibration traces.
LAUNCH_S, GEMM_OVERHEAD_S, GRAPH_BREAK_S = 1.7e-6, 2.3e-6, 2e-6
MEMORY_EFFICIENCY, GEMM_EFFICIENCY, INTEGER_EFFICIENCY = 0.75, 0.74, 0.85
TPU_LAUNCH_S, TPU_HOST_S = 0.3e-6, 100e-6
# The host's costs per call (docs/AOT.md, "The host"; `training/dispatch.py`), seconds.
HOST_CALL_S, HOST_ARRAY_S, HOST_GRAPH_UPDATE_S = 300e-6, 2.6e-6, 100e-6
HOST_GRAPH_LAUNCH_S, HOST_LAUNCH_S, HOST_RECAPTURE_S = 64e-6, 17e-6, 80e-6


def _module(fused: str, entry_params: str, entry_body: str) -> str:
  """An optimised-HLO module: fused computations, then an entry with `entry_params` and body lines."""
  return f"HloModule jit_step\n\n{fused}\nENTRY %main ({entry_params}) -> f32[] {{\n{entry_body}\n}}\n"


def _one(text: str) -> kernel_cost.Cost:
  costs = kernel_cost.costs(parse(text))
  assert len(costs) == 1, costs
  return costs[0]


SLICE = _module(
    "%fused_slice (param_0.1: f32[1024,256]) -> f32[8,256] {\n"
    "  %param_0.1 = f32[1024,256]{1,0} parameter(0)\n"
    "  %neg.1 = f32[1024,256]{1,0} negate(%param_0.1)\n"
    "  ROOT %slice.1 = f32[8,256]{1,0} slice(%neg.1), slice={[16:24], [0:256]}\n}\n",
    "p: f32[1024,256]",
    "  %p = f32[1024,256]{1,0} parameter(0)\n"
    "  ROOT %loop_slice_fusion = f32[8,256]{1,0} fusion(%p), kind=kLoop, calls=%fused_slice, "
    'metadata={op_name="jit(train_step)/optimizer/slice"}')


def test_a_fusion_that_slices_its_operand_reads_only_the_slice():
  cost = _one(SLICE)
  assert cost.read == 8 * 256 * 4  # 8 rows of 256 float32, not the 1024-row operand
  assert cost.written == 8 * 256 * 4
  assert cost.flops == 0 and cost.rounds == 0 and cost.phase == "optimizer"
  bandwidth = H100_BANDWIDTH * MEMORY_EFFICIENCY
  assert time_model.kernel_seconds(cost, H100) == pytest.approx(LAUNCH_S + 16384 / bandwidth)
  assert time_model.floor_seconds(cost, H100) == pytest.approx(16384 / H100_BANDWIDTH)


def test_a_broadcast_operand_is_read_once():
  text = _module(
      "%fused_add (param_0.2: f32[256], param_1.2: f32[1024,256]) -> f32[1024,256] {\n"
      "  %param_0.2 = f32[256]{0} parameter(0)\n"
      "  %broadcast.2 = f32[1024,256]{1,0} broadcast(%param_0.2), dimensions={1}\n"
      "  %param_1.2 = f32[1024,256]{1,0} parameter(1)\n"
      "  ROOT %add.2 = f32[1024,256]{1,0} add(%broadcast.2, %param_1.2)\n}\n",
      "b: f32[256], x: f32[1024,256]",
      "  %b = f32[256]{0} parameter(0)\n  %x = f32[1024,256]{1,0} parameter(1)\n"
      "  ROOT %loop_add_fusion = f32[1024,256]{1,0} fusion(%b, %x), kind=kLoop, calls=%fused_add")
  cost = _one(text)
  assert cost.read == 256 * 4 + 1024 * 256 * 4  # the bias once, not once per row
  assert cost.written == 1024 * 256 * 4


def test_an_in_place_dynamic_update_slice_writes_only_the_update():
  text = _module(
      "%fused_dus (param_0.3: f32[1024,256], param_1.3: f32[8,256], param_2.3: s32[]) -> f32[1024,256] {\n"
      "  %param_0.3 = f32[1024,256]{1,0} parameter(0)\n"
      "  %param_1.3 = f32[8,256]{1,0} parameter(1)\n"
      "  %param_2.3 = s32[] parameter(2)\n"
      "  %constant.3 = s32[] constant(0)\n"
      "  ROOT %dynamic-update-slice.3 = f32[1024,256]{1,0} dynamic-update-slice(%param_0.3, %param_1.3, "
      "%param_2.3, %constant.3)\n}\n",
      "q: f32[1024,256], u: f32[8,256], i: s32[]",
      "  %q = f32[1024,256]{1,0} parameter(0)\n  %u = f32[8,256]{1,0} parameter(1)\n  %i = s32[] parameter(2)\n"
      "  ROOT %dynamic-update-slice_fusion = f32[1024,256]{1,0} fusion(%q, %u, %i), kind=kLoop, calls=%fused_dus")
  cost = _one(text)
  assert cost.read == 8 * 256 * 4 + 4  # the update and the index; the target is updated in place
  assert cost.written == 8 * 256 * 4


GEMM_CONFIG = ('backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
               '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}')


@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (2048, 1024, 512)])
def test_a_cublas_gemm_does_2mnk_flops_at_the_gemm_efficiency(m, n, k):
  text = _module("", f"a: bf16[{m},{k}], b: bf16[{k},{n}]",
                 f"  %a = bf16[{m},{k}]{{1,0}} parameter(0)\n  %b = bf16[{k},{n}]{{1,0}} parameter(1)\n"
                 f"  ROOT %custom-call.1 = (bf16[{m},{n}]{{1,0}}, s8[33554432]{{0}}) custom-call(%a, %b), "
                 f'custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}')
  cost = _one(text)
  assert cost.kind == "GEMM (cuBLAS)" and cost.dtype == "bf16"
  assert cost.flops == 2 * m * n * k
  assert cost.read == 2 * (m * k + k * n) and cost.written == 2 * m * n  # the s8 workspace is not traffic
  compute = 2 * m * n * k / (H100_BF16 * GEMM_EFFICIENCY)
  memory = 2 * (m * k + k * n + m * n) / (H100_BANDWIDTH * MEMORY_EFFICIENCY)
  expected = LAUNCH_S + GEMM_OVERHEAD_S + max(compute, memory)
  assert time_model.kernel_seconds(cost, H100) == pytest.approx(expected)


def test_a_triton_gemm_fusion_counts_its_dot():
  text = _module(
      "%gemm_fusion_dot.4_computation (parameter_0.4: bf16[512,768], parameter_1.4: bf16[768,3072]) -> bf16[512,3072] {\n"
      "  %parameter_0.4 = bf16[512,768]{1,0} parameter(0)\n  %parameter_1.4 = bf16[768,3072]{1,0} parameter(1)\n"
      "  ROOT %dot.4 = bf16[512,3072]{1,0} dot(%parameter_0.4, %parameter_1.4), lhs_contracting_dims={1}, "
      "rhs_contracting_dims={0}\n}\n",
      "x: bf16[512,768], w: bf16[768,3072]",
      "  %x = bf16[512,768]{1,0} parameter(0)\n  %w = bf16[768,3072]{1,0} parameter(1)\n"
      "  ROOT %gemm_fusion_dot.4 = bf16[512,3072]{1,0} fusion(%x, %w), kind=kCustom, "
      'calls=%gemm_fusion_dot.4_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}')
  cost = _one(text)
  assert cost.kind == "GEMM (Triton fusion)"
  assert cost.flops == 2 * 512 * 3072 * 768


def _threefry_fusion(elements: int, rounds: int) -> str:
  """A fused computation computing `rounds` threefry-2x32 rounds on u32[elements] counters."""
  lines = [f"  %param_0.5 = u32[{elements}]{{0}} parameter(0)", f"  %param_1.5 = u32[{elements}]{{0}} parameter(1)",
           "  %c13 = u32[] constant(13)", f"  %r = u32[{elements}]{{0}} broadcast(%c13), dimensions={{}}",
           "  %c19 = u32[] constant(19)", f"  %l = u32[{elements}]{{0}} broadcast(%c19), dimensions={{}}"]
  x0, x1 = "%param_0.5", "%param_1.5"
  for i in range(rounds):  # x0 += x1; x1 = rotl(x1, 13); x1 ^= x0
    lines += [f"  %add.{i} = u32[{elements}]{{0}} add({x0}, {x1})",
              f"  %shl.{i} = u32[{elements}]{{0}} shift-left({x1}, %r)",
              f"  %shr.{i} = u32[{elements}]{{0}} shift-right-logical({x1}, %l)",
              f"  %or.{i} = u32[{elements}]{{0}} or(%shl.{i}, %shr.{i})",
              f"  %xor.{i} = u32[{elements}]{{0}} xor(%or.{i}, %add.{i})"]
    x0, x1 = f"%add.{i}", f"%xor.{i}"
  lines.append(f"  ROOT %compare.5 = pred[{elements}]{{0}} compare({x0}, {x1}), direction=LT")
  fused = f"%fused_compare (param_0.5: u32[{elements}], param_1.5: u32[{elements}]) -> pred[{elements}] {{\n"
  fused += "\n".join(lines) + "\n}\n"
  return _module(fused, f"k: u32[{elements}], c: u32[{elements}]",
                 f"  %k = u32[{elements}]{{0}} parameter(0)\n  %c = u32[{elements}]{{0}} parameter(1)\n"
                 f"  ROOT %loop_compare_fusion = pred[{elements}]{{0}} fusion(%k, %c), kind=kLoop, calls=%fused_compare")


def test_a_threefry_fusion_counts_its_hashes():
  elements = 1_000_000
  cost = _one(_threefry_fusion(elements, rounds=20))
  assert cost.rounds == 20 * elements  # one rotation per round and element
  prediction = time_model.predict(parse(_threefry_fusion(elements, rounds=20)), "h100")
  assert prediction["rng_hashes_per_step"] == elements  # 20 rounds make one hash
  rate = H100_INT32_OPS / 3 * INTEGER_EFFICIENCY  # INT32 lanes / 3 instructions a round
  memory = (2 * 4 * elements + elements) / (H100_BANDWIDTH * MEMORY_EFFICIENCY)
  assert time_model.kernel_seconds(cost, H100) == pytest.approx(LAUNCH_S + max(20 * elements / rate, memory))


def _host(arrays=0, updates=0, graph_launches=0, launches=0, recaptures=0) -> float:
  """The host's seconds for one call of a GPU program, by hand."""
  return (HOST_CALL_S + arrays * HOST_ARRAY_S + updates * HOST_GRAPH_UPDATE_S + graph_launches * HOST_GRAPH_LAUNCH_S
          + launches * HOST_LAUNCH_S + recaptures * HOST_RECAPTURE_S)


def test_pipelined_step_is_device_or_host_time_and_blocked_pays_both():
  p = time_model.predict(parse(SLICE), "h200")
  kernel = LAUNCH_S + 16384 / (H200_BANDWIDTH * MEMORY_EFFICIENCY)
  host = _host(arrays=2, launches=1)  # a parameter and a result; one kernel, too few for a CUDA graph
  assert p["host_per_call"]["arrays"] == 2 and p["host_per_call"]["launches"] == 1 and p["steps_per_call"] == 1
  assert p["predicted_device_ms"] == pytest.approx(1e3 * kernel)
  assert p["predicted_host_ms"] == pytest.approx(1e3 * host)
  assert p["predicted_step_ms"] == pytest.approx(1e3 * max(kernel, host))
  assert p["predicted_blocked_step_ms"] == pytest.approx(1e3 * (kernel + host))
  assert p["floor_ms"] == pytest.approx(1e3 * 16384 / H200_BANDWIDTH)
  assert p["bytes_per_step"] == 16384 and p["largest_kernels"][0]["name"] == "loop_slice_fusion"
  assert p["predicted_ms_by_phase"] == {"optimizer": pytest.approx(1e3 * kernel)}


def _gemms(m: int, count: int) -> str:
  """`count` cuBLAS GEMMs one after another, each on the last's result."""
  lines, x = [f"  %a = bf16[{m},{m}]{{1,0}} parameter(0)"], "%a"
  for i in range(count):
    root = "ROOT " if i == count - 1 else ""
    lines.append(f"  {root}%g{i} = (bf16[{m},{m}]{{1,0}}, s8[1024]{{0}}) custom-call({x}, %a), "
                 f'custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}')
    if i < count - 1:
      lines.append(f"  %x{i} = bf16[{m},{m}]{{1,0}} get-tuple-element(%g{i}), index=0")
      x = f"%x{i}"
  return _module("", f"a: bf16[{m},{m}]", "\n".join(lines))


def test_library_calls_between_cuda_graphs_cost_the_gpu_a_gap_and_inside_them_the_host_a_capture():
  """Five cuBLAS calls: kept out of the CUDA graphs ("kernels"), each costs the GPU a graph boundary
  and the host a launch; inside them ("xla"), one graph of five, which a host running ahead of the
  GPU captures again every call; "fixed": the same graph, never updated; "none": five launches."""
  m = 4096
  gemm = LAUNCH_S + GEMM_OVERHEAD_S + 2 * m ** 3 / (H100_BF16 * GEMM_EFFICIENCY)
  arrays = 3  # the parameter, and the root's GEMM result and workspace
  apart = time_model.predict(parse(_gemms(m, 5)), "h100", cuda_graphs="kernels")
  assert apart["library_calls_per_step"] == 5 and apart["cuda_graphs"] == "kernels"
  assert apart["predicted_device_ms"] == pytest.approx(1e3 * 5 * (gemm + GRAPH_BREAK_S))
  assert apart["predicted_host_ms"] == pytest.approx(1e3 * _host(arrays, launches=5))
  assert apart["predicted_step_ms"] == pytest.approx(apart["predicted_device_ms"])
  inside = time_model.predict(parse(_gemms(m, 5)), "h100", cuda_graphs="xla")
  host = _host(arrays, updates=1, graph_launches=1, recaptures=5)
  assert inside["predicted_device_ms"] == pytest.approx(1e3 * 5 * gemm) and host < 5 * gemm
  assert inside["host_per_call"]["recaptures"] == 5
  assert inside["predicted_host_ms"] == pytest.approx(1e3 * host)
  fixed = time_model.predict(parse(_gemms(m, 5)), "h100", cuda_graphs="fixed")
  assert fixed["predicted_host_ms"] == pytest.approx(1e3 * _host(arrays, graph_launches=1))
  none = time_model.predict(parse(_gemms(m, 5)), "h100", cuda_graphs="none")
  assert none["predicted_host_ms"] == pytest.approx(1e3 * _host(arrays, launches=5))
  slow_host = time_model.predict(parse(_gemms(64, 5)), "h100", cuda_graphs="xla")  # the host is slower: never ahead
  assert slow_host["host_per_call"]["recaptures"] == 0
  assert slow_host["predicted_host_ms"] == pytest.approx(1e3 * _host(arrays, updates=1, graph_launches=1))


def _loop(trips: int, kernels: int, annotated: bool = True) -> str:
  """A program whose entry runs `kernels` negations of a [1024, 256] array in a `while` of `trips`
  known trips (the step loop of `training/chunk_loop.repeated`), then one more outside it; not
  `annotated`: without XLA's `known_trip_count` (as XLA:TPU writes its loops), the counter copied in."""
  shape = "f32[1024,256]{1,0}"
  fused = f"%fneg (p.0: f32[1024,256]) -> f32[1024,256] {{\n  %p.0 = {shape} parameter(0)\n" \
          f"  ROOT %n.0 = {shape} negate(%p.0)\n}}\n"
  body = [f"  %bp = (s32[], {shape}) parameter(0)", "  %i = s32[] get-tuple-element(%bp), index=0",
          f"  %v0 = {shape} get-tuple-element(%bp), index=1"]
  for k in range(kernels):
    body.append(f"  %v{k + 1} = {shape} fusion(%v{k}), kind=kLoop, calls=%fneg")
  body += ["  %one = s32[] constant(1)", "  %i1 = s32[] add(%i, %one)",
           f"  ROOT %t = (s32[], {shape}) tuple(%i1, %v{kernels})"]
  cond = [f"  %cp = (s32[], {shape}) parameter(0)", "  %ci = s32[] get-tuple-element(%cp), index=0",
          f"  %n = s32[] constant({trips})", "  ROOT %lt = pred[] compare(%ci, %n), direction=LT"]
  fused += "%body (bp: (s32[], f32[1024,256])) -> (s32[], f32[1024,256]) {\n" + "\n".join(body) + "\n}\n"
  fused += "%cond (cp: (s32[], f32[1024,256])) -> pred[] {\n" + "\n".join(cond) + "\n}\n"
  annotation = f', backend_config={{"known_trip_count":{{"n":"{trips}"}}}}' if annotated else ""
  start = "%zero" if annotated else "%start"  # XLA:TPU copies the counter's initial constant in
  entry = (f"  %x = {shape} parameter(0)\n  %zero = s32[] constant(0)\n"
           + ("" if annotated else "  %start = s32[] copy(%zero)\n")
           + f"  %init = (s32[], {shape}) tuple({start}, %x)\n"
           f"  %w = (s32[], {shape}) while(%init), condition=%cond, body=%body{annotation}\n"
           f"  %y = {shape} get-tuple-element(%w), index=1\n"
           f"  ROOT %last = {shape} fusion(%y), kind=kLoop, calls=%fneg")
  return _module(fused, "x: f32[1024,256]", entry)


def test_a_call_of_k_steps_is_priced_per_step_with_the_host_paid_once_per_call():
  """Six kernels in a loop of K trips (with its counter's add and its condition's compare) and one
  after it: per step the loop's eight and a K-th of the last; the host updates the loop's CUDA graph
  once per call and launches it K times."""
  bandwidth = H100_BANDWIDTH * MEMORY_EFFICIENCY
  kernel = LAUNCH_S + 2 * 1024 * 256 * 4 / bandwidth
  counter = 2 * LAUNCH_S + (3 * 4 + 2 * 4 + 1) / bandwidth  # add: 2 int32 in, 1 out; compare: 2 in, a pred
  for trips in (1, 4):
    p = time_model.predict(parse(_loop(trips, 6)), "h100", cuda_graphs="kernels")
    assert p["steps_per_call"] == trips and p["kernels_per_step"] == pytest.approx(8 + 1 / trips)
    assert p["predicted_device_ms"] == pytest.approx(1e3 * (6 * kernel + counter + kernel / trips))
    host = _host(arrays=2, updates=1, graph_launches=trips, launches=1)  # the last kernel: one, no graph
    assert p["host_per_call"] == {"arrays": 2, "graph_updates": 1, "graph_launches": trips, "launches": 1,
                                  "recaptures": 0, "library_calls_launched": 0}
    assert p["predicted_host_ms"] == pytest.approx(1e3 * host / trips)


def test_a_loop_without_xlas_trip_count_is_counted_from_its_bounds():
  """XLA:TPU annotates no loop: a counted loop's trips are its condition's bound less its counter's first
  value (through the copy), so the step is priced as the annotated one, the counter's copy besides."""
  copy = LAUNCH_S + 2 * 4 / (H100_BANDWIDTH * MEMORY_EFFICIENCY)  # a 4-byte copy: read and written
  for trips in (1, 4):
    annotated = time_model.predict(parse(_loop(trips, 6)), "h100", cuda_graphs="kernels")
    counted = time_model.predict(parse(_loop(trips, 6, annotated=False)), "h100", cuda_graphs="kernels")
    assert counted["steps_per_call"] == annotated["steps_per_call"] == trips
    assert counted["kernels_per_step"] == pytest.approx(annotated["kernels_per_step"] + 1 / trips)
    assert counted["predicted_device_ms"] == pytest.approx(annotated["predicted_device_ms"] + 1e3 * copy / trips)
  module = parse(_loop(4, 6, annotated=False))
  loop = module.by_name["w"]
  assert hlo.trip_count(loop) == 1 and hlo.trip_count(loop, module) == hlo.counted_trips(loop, module) == 4


def _nested_loops(steps: int, blocks: int) -> str:
  """The GradCache step's shape: a step loop of `steps` known trips (`chunk_loop.repeated`) whose body runs
  five negations of a [1024, 256] array, then a block loop of `blocks` known trips (`grad_cache.by_blocks`'s
  scan) of six more, then its counter."""
  shape = "f32[1024,256]{1,0}"
  carry = f"(s32[], {shape})"
  text = f"%fneg (p.0: f32[1024,256]) -> f32[1024,256] {{\n  %p.0 = {shape} parameter(0)\n" \
         f"  ROOT %n.0 = {shape} negate(%p.0)\n}}\n"

  def loop(name: str, trips: int, body_lines: list[str], first: str) -> str:
    """The body and condition computations of loop `name` (counter at index 0, array at 1)."""
    body = [f"  %{name}_p = {carry} parameter(0)", f"  %{name}_i = s32[] get-tuple-element(%{name}_p), index=0",
            f"  %{first} = {shape} get-tuple-element(%{name}_p), index=1", *body_lines,
            f"  %{name}_one = s32[] constant(1)", f"  %{name}_i1 = s32[] add(%{name}_i, %{name}_one)",
            f"  ROOT %{name}_t = {carry} tuple(%{name}_i1, %{name}_out)"]
    cond = [f"  %{name}_cp = {carry} parameter(0)", f"  %{name}_ci = s32[] get-tuple-element(%{name}_cp), index=0",
            f"  %{name}_n = s32[] constant({trips})", f"  ROOT %{name}_lt = pred[] compare(%{name}_ci, %{name}_n), "
            "direction=LT"]
    return (f"%{name}_body ({name}_p: {carry}) -> {carry} {{\n" + "\n".join(body) + "\n}\n"
            f"%{name}_cond ({name}_cp: {carry}) -> pred[] {{\n" + "\n".join(cond) + "\n}\n")

  def negations(prefix: str, count: int, start: str) -> list[str]:
    names = [start] + [f"{prefix}{k}" for k in range(1, count + 1)]
    return [f"  %{names[k + 1]} = {shape} fusion(%{names[k]}), kind=kLoop, calls=%fneg" for k in range(count)]

  def run_loop(name: str, trips: int, start: str) -> list[str]:
    return [f"  %{name}_zero = s32[] constant(0)", f"  %{name}_init = {carry} tuple(%{name}_zero, %{start})",
            f"  %{name}_w = {carry} while(%{name}_init), condition=%{name}_cond, body=%{name}_body, "
            f'backend_config={{"known_trip_count":{{"n":"{trips}"}}}}']

  block_body = negations("b", 6, "b0") + [f"  %block_out = {shape} copy(%b6)"]
  step_body = (negations("s", 5, "s0") + run_loop("block", blocks, "s5")
               + [f"  %step_out = {shape} get-tuple-element(%block_w), index=1"])
  text += loop("block", blocks, block_body, "b0") + loop("step", steps, step_body, "s0")
  entry = "\n".join([f"  %x = {shape} parameter(0)", *run_loop("step", steps, "x"),
                     f"  ROOT %y = {shape} get-tuple-element(%step_w), index=1"])
  return _module(text, "x: f32[1024,256]", entry)


def test_a_loop_inside_the_step_runs_its_kernels_and_its_cuda_graph_once_per_trip():
  """GradCache's block loop inside the step loop: its kernels run `blocks` times a step, and the host
  launches its CUDA graph once per trip: XLA's default command buffers (FUSION, CUBLAS, CUBLASLT,
  CUSTOM_CALL, CUDNN; no WHILE) leave a `while` to the host, whose `WhileThunk` runs the body's thunks,
  each command buffer a launch, once per known trip. Per step: the step body's five negations, its
  counter's add and its condition's compare; `blocks` x (six negations, a copy, add, compare)."""
  bandwidth = H100_BANDWIDTH * MEMORY_EFFICIENCY
  array = 2 * 1024 * 256 * 4 / bandwidth  # a negation or a copy reads and writes the array
  counter = 2 * LAUNCH_S + (3 * 4 + 2 * 4 + 1) / bandwidth  # add: 2 int32 in, 1 out; compare: 2 in, a pred
  for steps, blocks in ((1, 4), (2, 4), (1, 1)):
    p = time_model.predict(parse(_nested_loops(steps, blocks)), "h100", cuda_graphs="kernels")
    assert p["steps_per_call"] == steps and p["kernels_per_step"] == pytest.approx(7 + 9 * blocks)
    assert p["predicted_device_ms"] == pytest.approx(
        1e3 * (5 * (LAUNCH_S + array) + counter + blocks * (7 * (LAUNCH_S + array) + counter)))
    # graphs: [step's compare, five negations], [block's compare, six negations, copy, add]; the step's add alone
    assert p["host_per_call"] == {"arrays": 2, "graph_updates": 2, "graph_launches": steps + steps * blocks,
                                  "launches": steps, "recaptures": 0, "library_calls_launched": 0}
    host = _host(arrays=2, updates=2, graph_launches=steps * (1 + blocks), launches=steps)
    assert p["predicted_host_ms"] == pytest.approx(1e3 * host / steps)


def test_a_deviceless_program_has_the_library_calls_its_gpu_would_autotune_to():
  """No cuBLAS call in a GPU program: plain GEMM fusions are taken as the autotuner's library calls
  in their measured share, spread evenly; a program with cuBLAS calls keeps its own."""
  plain = kernel_cost.Cost("g", "GEMM (Triton fusion)", "", plain_gemm=True)
  other = kernel_cost.Cost("f", "loop fusion", "")
  marked = host.library_calls([plain] * 100 + [other] * 5)
  assert sum(marked) == round(100 * 102 / 166) and not any(marked[100:])  # 102 of the calibrated step's 166
  tuned = [kernel_cost.Cost("c", "GEMM (cuBLAS)", "", library=True), plain]
  assert host.library_calls(tuned) == [True, False]


def test_the_time_model_explains_the_calibrated_h200_step(tmp_path):
  """The batch-50 step that ran on the lent H200 (its optimized HLO and measured times, in the shared
  calibration folder): predicted within 15 % of its pipelined time, host-bound as it was."""
  import tarfile

  from micse_jax import paths
  folder = os.path.join(os.path.dirname(paths.shared_data_dir()), "gpu-calibration", "h200-2026-11-28-056212b")
  if not os.path.isdir(folder):
    pytest.skip(f"the calibration folder {folder} is not here")
  with tarfile.open(os.path.join(folder, "raw.tar.gz")) as archive:
    archive.extract("b50.hlo.txt.gz", tmp_path, filter="data")
  point = next(p for p in json.load(open(os.path.join(folder, "summary.json")))["points"] if p["name"] == "b50")
  p = time_model.predict(parse(time_model.read_hlo(str(tmp_path / "b50.hlo.txt.gz"))), "h200", cuda_graphs="kernels")
  assert p["predicted_step_ms"] == pytest.approx(point["pipelined_step_ms"], rel=0.15)
  assert p["predicted_host_ms"] > p["predicted_device_ms"]  # host-bound, as measured
  assert p["predicted_device_ms"] == pytest.approx(point["profile"]["gpu_ms_per_step"], rel=0.15)


# Each target's memory bandwidth and float32 GEMM rate at the default precision (TF32 on Ampere and
# Hopper; a V100 has none: its float32 rate; a TPU: a third of its bf16 rate), from the peaks above.
GEMM_TARGETS = {"h100": (3.35e12, 494.7e12), "h200": (4.8e12, 494.7e12), "a100": (2.039e12, 156e12),
                "v100": (0.9e12, 15.7e12), "tpu-v4": (1.2e12, 275e12 / 3), "tpu-v5e": (0.819e12, 197e12 / 3),
                "tpu-v5p": (2.765e12, 459e12 / 3), "tpu-v6e": (1.64e12, 918e12 / 3)}


@pytest.mark.parametrize("target", sorted(GEMM_TARGETS))
def test_every_target_predicts_a_gemm(target):
  """One float32 cuBLAS GEMM of 1024³: on a GPU the launch, the GEMM's overhead and a CUDA-graph break
  beside the larger of its memory and compute times, the host's call with 3 arrays and one launch; on a
  TPU a fusion boundary and the program's one launch."""
  m = n = k = 1024
  text = _module("", f"a: f32[{m},{k}], b: f32[{k},{n}]",
                 f"  %a = f32[{m},{k}]{{1,0}} parameter(0)\n  %b = f32[{k},{n}]{{1,0}} parameter(1)\n"
                 f"  ROOT %custom-call.1 = f32[{m},{n}]{{1,0}} custom-call(%a, %b), "
                 f'custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}')
  assert sorted(GEMM_TARGETS) == sorted(time_model.DEVICES)  # every target has its figures here
  p = time_model.predict(parse(text), target)
  bandwidth, rate = GEMM_TARGETS[target]
  moved, flops = 4 * (m * k + k * n + m * n), 2 * m * n * k
  work = max(moved / (bandwidth * MEMORY_EFFICIENCY), flops / (rate * GEMM_EFFICIENCY))
  gpu = not target.startswith("tpu")
  device = LAUNCH_S + GEMM_OVERHEAD_S + GRAPH_BREAK_S + work if gpu else TPU_LAUNCH_S + work
  host_s = _host(arrays=3, launches=1) if gpu else TPU_HOST_S
  assert p["kernels_per_step"] == 1 and p["flops_per_step"] == flops and p["bytes_per_step"] == moved
  assert p["predicted_device_ms"] == pytest.approx(1e3 * device)
  assert p["predicted_host_ms"] == pytest.approx(1e3 * host_s)
  assert p["predicted_step_ms"] == pytest.approx(1e3 * max(device, host_s))
  assert p["floor_ms"] == pytest.approx(1e3 * max(moved / bandwidth, flops / rate))


def test_aot_hlo_predicts_a_saved_program(tmp_path, capsys):
  from micse_jax.bench import __main__ as bench
  path = tmp_path / "step.hlo.txt.gz"
  with gzip.open(path, "wt") as f:
    f.write(SLICE)
  result = bench.main(["--aot_hlo", str(path), "--aot", "h100"])
  last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  for key in ("predicted_step_ms", "predicted_blocked_step_ms", "floor_ms", "predicted_ms_by_phase",
              "predicted_ms_by_kind", "bytes_per_step", "rng_hashes_per_step", "largest_kernels", "kernels_per_step",
              "predicted_collective_ms", "predicted_exposed_collective_ms", "collectives_priced"):
    assert key in last and key in result, key
  assert last["kernels_per_step"] == 1 and last["bytes_per_step"] == 16384
  kernel = LAUNCH_S + 16384 / (H100_BANDWIDTH * MEMORY_EFFICIENCY)
  assert last["predicted_device_ms"] == pytest.approx(1e3 * kernel)
  assert last["predicted_step_ms"] == pytest.approx(1e3 * _host(arrays=2, launches=1))  # host-bound
  assert last["predicted_collective_ms"] == 0 and last["collectives_priced"] == []  # one device: no collective
  assert last["cuda_graphs"] == "kernels"  # --cuda_graphs auto, as an H100's program chooses
  assert bench.main(["--aot_hlo", str(path), "--aot", "v100"])["cuda_graphs"] == "xla"  # a V100's: XLA's graphs
  assert bench.main(["--aot_hlo", str(path), "--aot", "v100", "--cuda_graphs", "kernels"])["cuda_graphs"] == "kernels"


def test_aot_hlo_bad_file_is_one_error_line(tmp_path, capsys):
  from micse_jax.bench import __main__ as bench
  (tmp_path / "x.txt").write_text("not a program\n")
  for argv in (["--aot_hlo", str(tmp_path / "x.txt"), "--aot", "h100"], ["--aot_hlo", str(tmp_path / "absent")],
               ["--aot_hlo", str(tmp_path / "absent"), "--aot", "h100"]):
    with pytest.raises(SystemExit) as e:
      bench.entry(argv)
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err


def test_a_tpu_convolution_matmul_counts_2mnk():
  """XLA:TPU writes a matmul as a `convolution` (dim_labels bf_io->bf) inside a fusion."""
  text = _module(
      "%fused_conv (param_0.6: bf16[512,768], param_1.6: bf16[768,3072]) -> bf16[512,3072] {\n"
      "  %param_0.6 = bf16[512,768]{1,0} parameter(0)\n  %param_1.6 = bf16[768,3072]{1,0} parameter(1)\n"
      "  ROOT %convolution.6 = bf16[512,3072]{1,0} convolution(%param_0.6, %param_1.6), dim_labels=bf_io->bf\n}\n",
      "x: bf16[512,768], w: bf16[768,3072]",
      "  %x = bf16[512,768]{1,0} parameter(0)\n  %w = bf16[768,3072]{1,0} parameter(1)\n"
      "  ROOT %fusion.6 = bf16[512,3072]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_conv")
  cost = _one(text)
  assert cost.kind == "matmul fusion" and cost.flops == 2 * 512 * 3072 * 768
  device = time_model.DEVICES["tpu-v5e"]
  expected = TPU_LAUNCH_S + max(2 * 512 * 3072 * 768 / (TPU_V5E_BF16 * GEMM_EFFICIENCY),
                                2 * (512 * 768 + 768 * 3072 + 512 * 3072) / (TPU_V5E_BANDWIDTH * MEMORY_EFFICIENCY))
  assert time_model.kernel_seconds(cost, device) == pytest.approx(expected)


def test_a_tpu_batched_matmul_written_as_a_dilated_convolution_counts_one_tap_per_batch_element():
  """XLA:TPU writes a batched matmul (attention's QKᵀ: [128·12 batch, 32 x 64] · [64 x 32]) as a
  convolution whose window spans the batch with the input dilated as much: one multiply-add per
  feature and output element, not one per window position."""
  shape_q, shape_out = "bf16[128,12,32,64]", "bf16[128,12,32,32]"
  text = _module(
      f"%fused_bmm (param_0.7: {shape_q}, param_1.7: {shape_q}) -> {shape_out} {{\n"
      f"  %param_0.7 = {shape_q}{{3,2,1,0}} parameter(0)\n  %param_1.7 = {shape_q}{{3,2,1,0}} parameter(1)\n"
      f"  ROOT %convolution.7 = {shape_out}{{3,2,1,0}} convolution(%param_0.7, %param_1.7), "
      "window={size=128x12 stride=127x11 lhs_dilate=128x12}, dim_labels=01bf_01oi->01bf\n}\n",
      f"q: {shape_q}, k: {shape_q}",
      f"  %q = {shape_q}{{3,2,1,0}} parameter(0)\n  %k = {shape_q}{{3,2,1,0}} parameter(1)\n"
      f"  ROOT %fusion.7 = {shape_out}{{3,2,1,0}} fusion(%q, %k), kind=kOutput, calls=%fused_bmm")
  assert _one(text).flops == 2 * (128 * 12 * 32 * 32) * 64


TRIVIAL = "HloModule trivial, entry_computation_layout={()->f32[]}\n\nENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(1)\n}\n"


def test_a_program_without_kernels_is_priced_not_divided_by_zero(tmp_path, capsys):
  """An ENTRY returning a constant runs no kernel: 0 ms on the device, the host's call alone (no
  argument, one result), a floor of 0 and no ratio to it (it used to stop with a ZeroDivisionError)."""
  from micse_jax.bench import __main__ as bench
  p = time_model.predict(parse(TRIVIAL), "h100")
  assert p["kernels_per_step"] == 0 and p["predicted_device_ms"] == p["floor_ms"] == 0.0
  assert p["predicted_step_ms"] == p["predicted_host_ms"] == pytest.approx(1e3 * _host(arrays=1))
  assert p["predicted_over_floor"] is None
  path = tmp_path / "trivial.hlo"
  path.write_text(TRIVIAL)
  result = bench.main(["--aot_hlo", str(path), "--aot", "h100"])
  out = capsys.readouterr().out
  assert result["predicted_device_ms"] == 0.0 and "(predicted / floor n/a)" in out
  assert json.loads(out.strip().splitlines()[-1])["predicted_over_floor"] is None


@pytest.mark.parametrize("text, platform", [
    (SLICE, None),  # hand-written: nothing says
    (SLICE.replace("calls=%fused_slice,", 'calls=%fused_slice, backend_config={"operation_queue_id":"0"},'), "gpu"),
    (SLICE.replace("calls=%fused_slice,",
                   'calls=%fused_slice, backend_config={"outer_dimension_partitions":[]},'), "cpu"),
    (SLICE.replace("f32[8,256]{1,0} fusion", "f32[8,256]{1,0:T(8,128)} fusion"), "tpu")])
def test_the_platform_an_hlo_was_compiled_for(text, platform):
  assert hlo.compiled_for(text) == platform


def test_an_hlo_compiled_for_another_platform_is_one_error_line(tmp_path, capsys):
  """A program XLA compiled for this CPU (here) is refused for an H100 in one line naming its platform;
  a GPU's is refused for a TPU; the GPU's is priced for an H100."""
  import jax
  import jax.numpy as jnp

  from micse_jax.bench import __main__ as bench
  cpu = tmp_path / "cpu.hlo"
  x = jnp.ones((64, 64), device=jax.devices("cpu")[0])  # compiled for the CPU wherever the tests run
  cpu.write_text(jax.jit(lambda x: jnp.tanh(x @ x.T).sum()).lower(x).compile().as_text())
  gpu = tmp_path / "gpu.hlo"
  gpu.write_text(SLICE.replace("calls=%fused_slice,", 'calls=%fused_slice, backend_config={"operation_queue_id":"0"},'))
  for path, target, compiled_for in ((cpu, "h100", "CPU"), (gpu, "tpu-v5e", "GPU")):
    with pytest.raises(SystemExit) as e:
      bench.entry(["--aot_hlo", str(path), "--aot", target])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: --aot_hlo {path} was compiled for {compiled_for}, "
                                                   f"not for {target}'s platform")
  assert bench.main(["--aot_hlo", str(gpu), "--aot", "h100"])["kernels_per_step"] == 1


def test_the_aot_report_prints_per_step_counts_of_a_loop(monkeypatch):
  """A call of K steps whose kernels are not all in the loop has fractional counts per step (5 copies
  per call over 2 steps: 2.5); the report prints them as they are."""
  from micse_jax.bench import aot
  monkeypatch.setattr(time_model, "report_lines", lambda r: [])
  result = {"aot_target": "h100", "model": "tiny", "batch_size": 8, "max_length": 16, "dtype": "bfloat16",
            "num_devices": 1, "device_kind": "H100", "jax_version": "0", "compile_s": 1.0, "steps_per_dispatch": 2,
            "state_layout": "replicated", "kernels_per_step": 12.5, "update_kernels_per_step": 3,
            "by_kind": {"loop fusion": 10, "copy": 2.5}, "by_phase": {"optimizer": 3, "(no phase)": 9.5},
            "update_by_kind": {"loop fusion": 3},
            "memory_per_device": dict.fromkeys(("peak", "arguments", "outputs", "aliased", "temporaries"), 2 ** 30),
            "collectives": {}}
  lines = aot.report_lines(result)
  assert any(line.split() == ["copy", "2.5"] for line in lines)
  assert any(line.split() == ["(no", "phase)", "9.5"] for line in lines)
