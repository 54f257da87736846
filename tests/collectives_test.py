"""aot/collectives.py: collective counts and bytes read from optimised HLO text."""
import json
import os
import subprocess
import sys
import textwrap

from micse_jax.aot import collectives
from micse_jax.aot.collectives import collective_table
from micse_jax.aot.hlo import COLLECTIVE_KINDS
from micse_jax.aot.hlo_module import nbytes, parse
from tests.helpers import fake_devices_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HLO = """
HloModule jit_step, is_scheduled=true, num_partitions=4

%region_0.0 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

ENTRY %main.0_spmd (param: f32[2,16], p1: bf16[4,3]) -> f32[16] {
  %param = f32[2,16]{1,0} parameter(0), sharding={devices=[4,1]<=[4]}
  %p1 = bf16[4,3]{1,0} parameter(1)
  %all-gather = f32[8,16]{1,0} all-gather(%param), channel_id=1, dimensions={0}
  %all-gather-start = (f32[2,16]{1,0}, f32[8,16]{1,0}) all-gather-start(%param), channel_id=2
  %all-gather-done = f32[8,16]{1,0} all-gather-done(%all-gather-start)
  %all-reduce = (f32[16]{0}, bf16[4,3]{1,0}) all-reduce(%param, %p1), to_apply=%region_0.0
  %all-to-all.1 = bf16[4,3]{1,0} all-to-all(%p1), dimensions={0}
  %cp-start = (f32[2,16]{1,0}, f32[2,16]{1,0}, u32[], u32[]) collective-permute-start(%param)
  %cp-done = f32[2,16]{1,0} collective-permute-done(%cp-start)
  %rs = f32[2,16]{1,0} reduce-scatter(%all-gather), dimensions={0}, to_apply=%region_0.0
  ROOT %fusion = f32[16]{0} fusion(%all-gather), kind=kLoop, calls=%region_0.0
}
"""


def test_nbytes_of_arrays_tuples_and_scalars():
  assert nbytes("f32[8,16]{1,0}") == 8 * 16 * 4
  assert nbytes("(f32[16]{0}, bf16[4,3]{1,0})") == 16 * 4 + 12 * 2
  assert nbytes("pred[3]") == 3 and nbytes("s32[]") == 4
  assert nbytes("f8e4m3fn[10]{0}") == 10 and nbytes("c64[2]") == 16
  assert nbytes("(s32[], token[])") == 4 and nbytes("s4[3]{0}") == 1.5  # half a byte an element


def test_hand_written_hlo_counts_async_pairs_once():
  table = collective_table(parse(_HLO))
  assert set(table) == set(COLLECTIVE_KINDS)
  assert table["all-gather"] == {"count": 2, "bytes": 2 * 512, "max_bytes": 512}
  assert table["all-reduce"] == {"count": 1, "bytes": 64 + 24, "max_bytes": 88}
  assert table["all-to-all"] == {"count": 1, "bytes": 24, "max_bytes": 24}
  assert table["collective-permute"] == {"count": 1, "bytes": 128, "max_bytes": 128}
  assert table["reduce-scatter"] == {"count": 1, "bytes": 128, "max_bytes": 128}


_COMPILED = textwrap.dedent("""
  import json
  import jax, jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from micse_jax.aot.collectives import collective_table
  from micse_jax.aot.hlo_module import parse
  mesh = Mesh(jax.devices(), ("data",))
  def gather_then_sum(x):  # x [8, 24] sharded by rows: one all-gather of the whole f32[8, 24]
    full = jax.lax.with_sharding_constraint(x * 2.0, NamedSharding(mesh, P()))
    return full @ full.T
  x = jax.device_put(jnp.ones((8, 24)), NamedSharding(mesh, P("data")))
  hlo = jax.jit(gather_then_sum).lower(x).compile().as_text()
  print(json.dumps(collective_table(parse(hlo))))
""")


def test_compiled_function_on_four_fake_devices_gathers_the_known_size():
  env = fake_devices_env(4)
  out = subprocess.run([sys.executable, "-c", _COMPILED], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  table = json.loads(out.stdout.strip().splitlines()[-1])
  assert table["all-gather"]["count"] == 1
  assert table["all-gather"]["max_bytes"] == 8 * 24 * 4
  assert sum(row["count"] for kind, row in table.items() if kind != "all-gather") == 0


def test_replica_groups_in_every_form_xla_prints():
  groups = collectives.device_groups
  assert groups("all-reduce(%x), replica_groups={}, to_apply=%a", 4) == ((0, 1, 2, 3),)
  assert groups("all-reduce(%x), to_apply=%a", 2) == ((0, 1),)
  assert groups("replica_groups={{0,2},{1,3}}, to_apply=%a", 4) == ((0, 2), (1, 3))
  # iota: arange(8) as [4,2], transposed, cut into 2 groups of 4
  assert groups("replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%a", 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert groups("replica_groups=[4,2]<=[8], to_apply=%a", 8) == ((0, 1), (2, 3), (4, 5), (6, 7))
  # mesh axes: devices that share the other axes form a group
  assert groups("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global_device_ids=true", 8) == \
      (tuple(range(8)),)
  assert groups("replica_groups=mesh['a'=2,'b'=4] {'a'}, to_apply=%a", 8) == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert groups("replica_groups=mesh['a'=2,'b'=4] {'b'}, to_apply=%a", 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert groups("replica_groups=mesh['a'=8] {'a':(2)2}, to_apply=%a", 8) == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_program_collectives_reads_sizes_groups_and_sync():
  module = parse(_HLO)
  found = collectives.program_collectives(module)
  assert module.num_devices == 4
  assert found["all-gather"].size == 2 * 16 * 4 * 4 and found["all-gather"].sync  # operand x 4 devices
  assert found["all-gather-start"].size == 2 * 16 * 4 * 4 and not found["all-gather-start"].sync
  assert found["all-reduce"].size == 2 * 16 * 4 + 4 * 3 * 2 and found["all-reduce"].groups == ((0, 1, 2, 3),)
  assert found["rs"].kind == "reduce-scatter" and found["rs"].size == 8 * 16 * 4  # its input
  assert set(found) == {"all-gather", "all-gather-start", "all-reduce", "all-to-all.1", "cp-start", "rs"}
