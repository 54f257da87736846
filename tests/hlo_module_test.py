"""aot/hlo_module.py on hand-written HLO: the one grammar every reader of a compiled program reads
(instructions with their shapes, operands and calls), shapes' bytes, the instruction an
`async-start` runs, and the devices a module runs on."""
from micse_jax.aot.hlo_module import nbytes, parse

HLO = """HloModule jit_step, num_partitions=2, replica_count=2

%wrapped_gather (p.0: f32[4,8]) -> f32[8,8] {
  %p.0 = f32[4,8]{1,0} parameter(0)
  ROOT %all-gather.0 = f32[8,8]{1,0} all-gather(%p.0), dimensions={0}, replica_groups={{0,1}}
}

%fused_add (p.1: f32[8,8], p.2: f32[8,8]) -> (f32[8,8], f32[]) {
  %p.1 = f32[8,8]{1,0} parameter(0)
  %p.2 = f32[8,8]{1,0} parameter(1)
  %add.1 = f32[8,8]{1,0} add(%p.1, %p.2)
  %zero = f32[] constant(0)
  ROOT %t = (f32[8,8]{1,0}, f32[]) tuple(%add.1, %zero)
}

ENTRY %main (x: f32[4,8], y: f32[8,8]) -> (f32[8,8], f32[]) {
  %x = f32[4,8]{1,0} parameter(0)
  %y = f32[8,8]{1,0} parameter(1)
  %start = ((f32[4,8]{1,0}), f32[8,8]{1,0}) async-start(%x), calls=%wrapped_gather
  %done = f32[8,8]{1,0} async-done(%start)
  ROOT %fusion = (f32[8,8]{1,0}, f32[]) fusion(%done, %y), kind=kLoop, calls=%fused_add, metadata={op_name="a(b)"}
}
"""


def test_one_parse_gives_computations_instructions_and_devices():
  module = parse(HLO)
  assert module.entry == "main" and list(module.computations) == ["wrapped_gather", "fused_add", "main"]
  assert module.num_devices == 4  # 2 partitions x 2 replicas
  start, fusion = module.by_name["start"], module.by_name["fusion"]
  assert start.opcode == "async-start" and start.shape == "((f32[4,8]{1,0}), f32[8,8]{1,0})"
  assert fusion.operands == ("done", "y") and fusion.root and not start.root  # metadata's "(b)" is no operand
  assert fusion.called() == ["fused_add"] and fusion.op_name() == "a(b)"
  assert module.shapes["t"] == "(f32[8,8]{1,0}, f32[])"
  assert module.called_instructions(fusion)[2].operands == ("p.1", "p.2")  # fused_add's add.1


def test_an_async_start_is_the_instruction_it_wraps():
  module = parse(HLO)
  assert module.unwrap(module.by_name["start"]).name == "all-gather.0"
  assert module.unwrap(module.by_name["fusion"]).name == "fusion"  # any other: itself


def test_nbytes_counts_each_element_type_by_its_width():
  assert nbytes("(f32[8,8]{1,0}, f32[])") == 4 * 64 + 4
  assert nbytes("(bf16[3]{0}, pred[2], s8[5], f64[1])") == 6 + 2 + 5 + 8
  assert nbytes("u4[5]{0}") == 2.5 and nbytes("token[]") == 0
