"""An optimised HLO module's text, parsed once into the one structure every reader of a compiled
program reads: its kernels (`hlo`), what they move and compute (`kernel_cost`), its collectives
(`collectives`), the host's work (`host`) and the step time (`time_model`).

`parse(compiled.as_text())` gives a `Module`: its computations, each a list of `Instruction`s in
the text's order (a scheduled module's program order), the entry computation's name, every
instruction by name and the devices the module runs on. One grammar reads every instruction line,

    [ROOT] %name = <result shape> opcode(operands), attributes

(the shape may be a tuple `(f32[2]{0}, s8[64]{0})`); `nbytes` counts a shape's bytes from its
element types' widths; `Module.unwrap` gives the instruction that does an `async-start`'s work.
"""
from __future__ import annotations

import dataclasses
import math
import re

# Instructions that launch nothing: no data moved or computed.
NO_WORK = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
           "replica-id", "add-dependency", "opt-barrier", "domain"}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
                          r"(?P<opcode>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ARRAY = re.compile(r"\b(pred|token|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of an optimised module: its name, opcode, result shape (as written), operand
  names, whether it is its computation's ROOT, and its whole line."""
  name: str
  opcode: str
  shape: str
  operands: tuple[str, ...]
  text: str
  root: bool = False

  def called(self) -> list[str]:
    """Names of the computations this instruction calls (fused, body, branches, ...)."""
    names = _CALLED.findall(self.text)
    for group, single in _BRANCHES.findall(self.text):
      names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()] if group else [single]
    return names

  def op_name(self) -> str | None:
    """The `op_name` of the instruction's metadata (its jax name stack), or None."""
    match = _OP_NAME.search(self.text)
    return match.group(1) if match else None


def _operands(rest: str) -> tuple[str, ...]:
  """Names of the operands: the `%names` inside the opcode's parentheses (`rest` starts after the `(`)."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return tuple(_OPERAND.findall(rest[:i]))
  return tuple(_OPERAND.findall(rest))


def element_bits(dtype: str) -> int:
  """Bits per element of an HLO primitive type: the width its name ends in (`f32` 32, `bf16` 16,
  `f8e4m3fn` 8, `s4` 4), `pred` 8, `token` 0."""
  if dtype in ("pred", "token"):
    return 8 if dtype == "pred" else 0
  return int(re.match(r"[a-z]+(\d+)", dtype).group(1))


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """[(element type, dims)] of a shape's arrays (a tuple shape gives each element)."""
  return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


def array_bytes(found: list[tuple[str, tuple[int, ...]]]) -> int | float:
  """Bytes of `arrays`' [(element type, dims)]: an int, or a float where sub-byte elements leave a part."""
  bits = sum(element_bits(t) * math.prod(dims) for t, dims in found)
  return bits // 8 if bits % 8 == 0 else bits / 8


def nbytes(shape: str) -> int | float:
  """Bytes of a (possibly tuple) shape (`array_bytes` of its arrays)."""
  return array_bytes(arrays(shape))


@dataclasses.dataclass(frozen=True, eq=False)
class Module:
  """An optimised HLO module (see the module docstring); `text` is what it was parsed from."""
  text: str
  computations: dict[str, list[Instruction]]
  entry: str | None
  by_name: dict[str, Instruction]
  shapes: dict[str, str]  # {instruction name: its result shape}
  num_devices: int

  def called_instructions(self, ins: Instruction) -> list[Instruction]:
    """The instructions of every computation `ins` calls."""
    return [i for c in ins.called() for i in self.computations.get(c, ())]

  def fused(self, ins: Instruction) -> str | None:
    """The computation a fusion calls."""
    called = ins.called()
    return called[0] if called else None

  def unwrap(self, ins: Instruction) -> Instruction | None:
    """The instruction that does `ins`'s work: an `async-start`'s wrapped instruction (the last of its
    computation that is no `NO_WORK`; None when there is none), any other instruction itself."""
    if ins.opcode != "async-start":
      return ins
    wrapped = [i for i in self.called_instructions(ins) if i.opcode not in NO_WORK]
    return wrapped[-1] if wrapped else None


def _num_devices(text: str) -> int:
  """Devices a module runs on: its header's `num_partitions` x `replica_count` (1 if absent)."""
  found = re.search(r"^HloModule[^\n]*", text, re.MULTILINE)
  header = found.group(0) if found else ""
  count = lambda key: int(m.group(1)) if (m := re.search(rf"\b{key}=(\d+)", header)) else 1
  return count("num_partitions") * count("replica_count")


def parse(text: str) -> Module:
  """The `Module` of an optimised HLO module's text (`compiled.as_text()`)."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = computations.setdefault(header.group("name"), [])
      if line.startswith("ENTRY"):
        entry = header.group("name")
      continue
    match = _INSTRUCTION.match(line)
    if match and current is not None:
      current.append(Instruction(match.group("name"), match.group("opcode"), match.group("shape"),
                                 _operands(match.group("rest")), line, bool(match.group("root"))))
  by_name = {i.name: i for body in computations.values() for i in body}
  shapes = {name: ins.shape for name, ins in by_name.items()}
  return Module(text, computations, entry, by_name, shapes, _num_devices(text))
