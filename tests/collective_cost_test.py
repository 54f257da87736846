"""The interconnect in the time model (`aot/interconnect.py`, `aot/time_model.py`) on hand-written
HLO: collectives priced by NCCL's algorithms from the public figures (typed here, not read from
the code), across nodes hierarchically, on a TPU slice's ICI, and hidden by the compute scheduled
between an async pair's start and done."""
import pytest

from micse_jax.aot import collectives, interconnect, time_model, topology
from micse_jax.aot.hlo_module import parse
from micse_jax.errors import ConfigError

MIB = 2 ** 20
ADD = "%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n" \
      "  ROOT %s = f32[] add(%a, %b)\n}\n"
GEMM = ('custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":'
        '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
        '"rhs_batch_dimensions":[]}}}')


def _all_reduce(elements: int, devices: int, groups: str = "", between: int = 0, sync: bool = False) -> str:
  """An f32[elements] all-reduce on `devices` (`groups`: its replica_groups, default all), async
  unless `sync`, with `between` bf16[4096,4096] GEMMs scheduled between its start and done."""
  groups = groups or "{{" + ",".join(map(str, range(devices))) + "}}"
  head = f"HloModule jit_step, is_scheduled=true, num_partitions={devices}\n\n{ADD}\n"
  lines = [f"ENTRY %main (g: f32[{elements}], x: bf16[4096,4096]) -> f32[{elements}] {{",
           f"  %g = f32[{elements}]{{0}} parameter(0)", "  %x = bf16[4096,4096]{1,0} parameter(1)"]
  collective = f"replica_groups={groups}, use_global_device_ids=true, to_apply=%add"
  if sync:
    lines.append(f"  %ar = f32[{elements}]{{0}} all-reduce(%g), channel_id=1, {collective}")
  else:
    lines.append(f"  %ar-start = f32[{elements}]{{0}} all-reduce-start(%g), channel_id=1, {collective}")
  for i in range(between):
    lines.append(f"  %gemm.{i} = (bf16[4096,4096]{{1,0}}, s8[4194304]{{0}}) custom-call(%x, %x), {GEMM}")
  if not sync:
    lines.append(f"  %ar = f32[{elements}]{{0}} all-reduce-done(%ar-start)")
  lines.append(f"  ROOT %out = f32[{elements}]{{0}} negate(%ar)")
  return head + "\n".join(lines) + "\n}\n"


def _priced(text: str, target: str):
  module = parse(text)
  found = collectives.program_collectives(module)
  (name, collective), = found.items()
  return interconnect.seconds(collective, target, module.num_devices)


def test_a100_ring_all_reduce_is_latency_plus_bus_bytes_over_nccl_tests_bandwidth():
  """8 A100s, 256 MiB: NCCL's ring / Simple, 8.4 us + 14 steps x 3.4 us, 2·7/8 of the bytes at
  the 235 GB/s nccl-tests bus bandwidth of NVLink 3; 4 bytes: the LL ring, 6.6 + 14 x 0.6 us."""
  size = 256 * MIB
  seconds, algorithm = _priced(_all_reduce(size // 4, 8), "a100")
  assert algorithm == "ring/Simple"
  assert seconds == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * size / 235e9)
  seconds, algorithm = _priced(_all_reduce(1, 8), "a100")
  assert algorithm == "ring/LL" and seconds == pytest.approx(6.6e-6 + 14 * 0.6e-6 + 2 * 7 / 8 * 4 / 87.7e9)


def test_h100_node_all_reduce_takes_nvlink_sharp():
  """8 H100s on NVSwitch gen 3: NVLS, 25 us + 2·7/8 of the bytes at 480 GB/s (nccl-tests bus
  bandwidth with NVLink SHARP on 8 GPUs)."""
  size = 256 * MIB
  seconds, algorithm = _priced(_all_reduce(size // 4, 8), "h100")
  assert algorithm == "NVLS" and seconds == pytest.approx(25e-6 + 2 * 7 / 8 * size / 480e9)


def test_sixteen_gpus_on_two_nodes_reduce_hierarchically():
  """Two nodes of 8: reduce-scatter in the node, all-reduce of 1/8 between the nodes over each
  GPU's 400 Gb/s NIC (80 % reached: 40 GB/s), all-gather in the node, pipelined. A100: NCCL's
  tree, latency 8.4 + 2 (7 x 4 + log2(2) x 14) us, the node part at the 235 GB/s ring; H100: the
  NVLS tree, 25 + 2 x 20.9 us, the node part at the 480 GB/s of NVLink SHARP."""
  size = 256 * MIB
  network = 2 * 1 / 2 * (size / 8) / 40e9
  seconds, algorithm = _priced(_all_reduce(size // 4, 16), "a100")
  assert algorithm == "hierarchical"
  assert seconds == pytest.approx(8.4e-6 + 2 * (7 * 4e-6 + 14e-6) + max(2 * 7 / 8 * size / 235e9, network))
  ring = 8.4e-6 + 28 * 3.4e-6 + 2 * 14e-6 + 2 * 15 / 16 * size / min(235e9, 8 * 40e9)
  assert seconds < ring  # the flat ring over both nodes is the slower candidate
  seconds, algorithm = _priced(_all_reduce(size // 4, 16), "h100")
  assert algorithm == "NVLS tree"
  assert seconds == pytest.approx(25e-6 + 2 * 20.9e-6 + max(2 * 7 / 8 * size / 480e9, network))


def test_groups_of_two_pay_less_than_groups_of_eight():
  """replica_groups of 2 GPUs move (2-1)/2·2 = 1 x the bytes in 2 steps; 8 GPUs 1.75 x in 14."""
  size = 64 * MIB
  pairs = "{{0,1},{2,3},{4,5},{6,7}}"
  two, algorithm = _priced(_all_reduce(size // 4, 8, groups=pairs), "a100")
  assert algorithm == "ring/Simple" and two == pytest.approx(8.4e-6 + 2 * 3.4e-6 + size / 235e9)
  eight, _ = _priced(_all_reduce(size // 4, 8), "a100")
  assert eight == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 1.75 * size / 235e9) and two < eight
  across, algorithm = _priced(_all_reduce(size // 4, 16, groups="{{0,8},{1,9}}"), "a100")
  assert across == pytest.approx(8.4e-6 + 2 * 14e-6 + size / 40e9)  # each pair over its two NICs


def test_an_async_pair_costs_only_what_the_compute_between_does_not_hide():
  size = 64 * MIB
  price, _ = _priced(_all_reduce(size // 4, 8), "h100")
  gemm = (time_model.LAUNCH_S + time_model.GEMM_OVERHEAD_S + time_model.GRAPH_BREAK_S  # a cuBLAS call between graphs
          + 2 * 4096 ** 3 / (989.4e12 * time_model.GEMM_EFFICIENCY))
  assert 10 * gemm > price  # ten GEMMs (about 2 ms) are more than enough to hide it
  hidden = time_model.predict(parse(_all_reduce(size // 4, 8, between=10)), "h100")
  negate = hidden["predicted_device_ms"] - 10 * 1e3 * gemm
  assert hidden["predicted_collective_ms"] == pytest.approx(1e3 * price)
  assert hidden["predicted_exposed_collective_ms"] == pytest.approx(0.0, abs=1e-9)
  bare = time_model.predict(parse(_all_reduce(size // 4, 8)), "h100")
  assert bare["predicted_exposed_collective_ms"] == pytest.approx(1e3 * price)
  assert bare["predicted_device_ms"] == pytest.approx(negate + 1e3 * price)
  one = time_model.predict(parse(_all_reduce(size // 4, 8, between=1)), "h100")
  assert one["predicted_exposed_collective_ms"] == pytest.approx(1e3 * (price - gemm))
  sync = time_model.predict(parse(_all_reduce(size // 4, 8, between=10, sync=True)), "h100")
  assert sync["predicted_exposed_collective_ms"] == pytest.approx(1e3 * price)  # a sync one is all exposed


def test_collectives_share_one_link_one_after_another():
  """Two async all-reduces started back to back: the second starts when the first is done."""
  one = _all_reduce(16 * MIB, 8)
  two = one.replace("  %ar = f32[16777216]{0} all-reduce-done(%ar-start)",
                    "  %ar2-start = f32[16777216]{0} all-reduce-start(%g), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, "
                    "to_apply=%add\n  %ar = f32[16777216]{0} all-reduce-done(%ar-start)\n"
                    "  %ar2 = f32[16777216]{0} all-reduce-done(%ar2-start)")
  price = time_model.predict(parse(one), "h100")["predicted_collective_ms"]
  both = time_model.predict(parse(two), "h100")
  assert both["predicted_collective_ms"] == pytest.approx(2 * price)
  assert both["predicted_exposed_collective_ms"] == pytest.approx(2 * price)


def test_tpu_all_reduce_runs_on_the_slices_ici():
  """v5e-8 is a 2x4 slice without wraparound (a v5e pod wraps only at 16): its corner chips have
  2 links of 50 GB/s a direction; a v5p 4x4x4 cube wraps, 6 links of 100 GB/s."""
  size = 64 * MIB
  assert topology.tpu_slice("tpu-v5e", 8) == (2, 4) and topology.tpu_slice("tpu-v5p", 64) == (4, 4, 4)
  seconds, algorithm = _priced(_all_reduce(size // 4, 8), "tpu-v5e")
  assert algorithm == "ICI" and seconds == pytest.approx(10e-6 + 2 * 7 / 8 * size / (2 * 50e9))
  seconds, _ = _priced(_all_reduce(size // 4, 64), "tpu-v5p")
  assert seconds == pytest.approx(10e-6 + 2 * 63 / 64 * size / (6 * 100e9))
  on_chip, _ = _priced(_all_reduce(size // 4, 8, groups="{{0,1},{2,3},{4,5},{6,7}}"), "tpu-v4")
  assert on_chip == 0.0  # a v4's two TensorCores are one chip: nothing crosses ICI


def test_gpu_topology_makes_nodes_of_eight():
  assert topology.gpu_topology(8) == "1x1x8" and topology.gpu_topology(2) == "1x1x2"
  assert topology.gpu_topology(16) == "2x1x8"
  with pytest.raises(ConfigError, match="multiple of 8"):
    topology.gpu_topology(12)


def _tpu_fused_gather(between: int) -> str:
  """XLA:TPU's form: an all-gather inside a fusion that starts it and one that waits for it (one
  channel), `between` matmul fusions scheduled between them, on 8 v5e chips."""
  group = "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}"
  fused = "".join(
      f"%gather_{part} (p.{part}: bf16[8,4096]) -> bf16[64,4096] {{\n  %p.{part} = bf16[8,4096]{{1,0}} parameter(0)\n"
      f"  ROOT %all-gather.{part} = bf16[64,4096]{{1,0}} all-gather(%p.{part}), channel_id=7, {group}\n}}\n"
      for part in ("start", "done"))
  fused += ("%matmul (a: bf16[4096,4096]) -> bf16[4096,4096] {\n  %a = bf16[4096,4096]{1,0} parameter(0)\n"
            "  ROOT %c = bf16[4096,4096]{1,0} convolution(%a, %a), dim_labels=bf_io->bf\n}\n")
  lines = ["  %x = bf16[8,4096]{1,0} parameter(0)", "  %w = bf16[4096,4096]{1,0} parameter(1)",
           "  %async-collective-start = bf16[64,4096]{1,0} fusion(%x), kind=kCustom, calls=%gather_start"]
  lines += [f"  %mm.{i} = bf16[4096,4096]{{1,0}} fusion(%w), kind=kOutput, calls=%matmul" for i in range(between)]
  lines += ["  ROOT %async-collective-done = bf16[64,4096]{1,0} fusion(%x), kind=kCustom, calls=%gather_done"]
  return (f"HloModule jit_step, is_scheduled=true, num_partitions=8\n\n{fused}\n"
          "ENTRY %main (x: bf16[8,4096], w: bf16[4096,4096]) -> bf16[64,4096] {\n" + "\n".join(lines) + "\n}\n")


def test_a_tpu_collective_carried_through_fusions_is_hidden_by_the_matmuls_between():
  price = 10e-6 + 7 / 8 * (8 * 4096 * 2 * 8) / (2 * 50e9)  # v5e 2x4: 2 links of 50 GB/s
  hidden = time_model.predict(parse(_tpu_fused_gather(between=2)), "tpu-v5e")
  assert hidden["predicted_collective_ms"] == pytest.approx(1e3 * price)
  assert [c["name"] for c in hidden["collectives_priced"]] == ["async-collective-start"]  # one channel, once
  assert hidden["predicted_exposed_collective_ms"] == pytest.approx(0.0, abs=1e-9)
  bare = time_model.predict(parse(_tpu_fused_gather(between=0)), "tpu-v5e")
  assert bare["predicted_exposed_collective_ms"] == pytest.approx(1e3 * price)
