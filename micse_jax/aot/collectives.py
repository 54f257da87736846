"""Cross-device collectives of a compiled step, read from its optimised HLO text.

`collective_table(hlo_module.parse(jitted.lower(...).compile().as_text()))` counts every collective
instruction by kind and adds up the bytes of its result (per device). An asynchronous pair
(`all-gather-start` / `all-gather-done`) is one collective: the `-done` half is counted, with
its result shape (the gathered / reduced array); the `-start` half is skipped. A collective
that a backend wraps in an `async-start` computation is counted once, where the wrapped
computation names it.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from micse_jax.aot import hlo
from micse_jax.aot.hlo_module import Instruction, Module, nbytes


def _collective_kind(opcode: str) -> str | None:
  """The collective kind an opcode counts as, or None (`-start` halves count as None)."""
  if opcode.endswith("-start"):
    return None
  base = opcode[:-len("-done")] if opcode.endswith("-done") else opcode
  return base if base in hlo.COLLECTIVE_KINDS else None


def collective_table(module: Module) -> dict[str, dict[str, int]]:
  """Collectives of an optimised HLO module: {kind: {"count", "bytes", "max_bytes"}}.

  Every kind in `hlo.COLLECTIVE_KINDS` is present (zeros when absent). `bytes` sums, and
  `max_bytes` is the largest of, the per-device result sizes of that kind's instructions
  (in whole bytes).
  """
  table = {kind: {"count": 0, "bytes": 0, "max_bytes": 0} for kind in hlo.COLLECTIVE_KINDS}
  for body in module.computations.values():
    for ins in body:
      kind = _collective_kind(ins.opcode)
      if kind is None:
        continue
      size = math.ceil(nbytes(ins.shape))
      row = table[kind]
      row["count"] += 1
      row["bytes"] += size
      row["max_bytes"] = max(row["max_bytes"], size)
  return table


# ----- Each collective of a program, with the devices that take part (for the time model) -----

_GROUPS = re.compile(r"replica_groups=(\{\}|\{\{[\d,{}\s]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                     r"|mesh\[[^\]]*\](?:,\s*device_ids=\([^)]*\))?\s*\{[^}]*\})")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_AXIS = re.compile(r"'?([\w.\-]+)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program: its kernel's name (the `-start` half of an async pair,
  or the instruction), kind, `size` in bytes as nccl-tests counts it (the whole array: what one
  device contributes to an all-reduce, a reduce-scatter's input, an all-gather's output, an
  all-to-all's input; what one device sends in a collective-permute), the device groups that
  run it (`pairs` for a collective-permute), whether it runs on the compute stream (`sync`), and
  the kernel that waits for it when that is no `-done` instruction (`done`: XLA:TPU's async
  collective fusions, one collective's channel carried through several fusions)."""
  name: str
  kind: str
  size: float
  groups: tuple[tuple[int, ...], ...]
  sync: bool = False
  pairs: tuple[tuple[int, int], ...] = ()
  done: str = ""


def _ints(text: str) -> list[int]:
  return [int(v) for v in re.findall(r"\d+", text)]


def _iota_groups(text: str) -> list[list[int]]:
  """`[groups,size]<=[dims]T(perm)`: iota over `dims`, transposed by `perm`, cut into groups."""
  shape, dims, perm = _IOTA.match(text).groups()
  ids = np.arange(math.prod(_ints(dims))).reshape(_ints(dims))
  if perm:
    ids = ids.transpose(_ints(perm))
  return ids.reshape(_ints(shape)).tolist()


def _mesh_groups(text: str) -> list[list[int]]:
  """`mesh['a'=2,'b'=4][, device_ids=(...)] {'b'}`: the devices sharing every other axis form a
  group (a sub-axis `'b':(pre)size` splits its axis into [pre, size, rest] and groups the middle)."""
  head, axes = text.rsplit("{", 1)
  mesh = re.match(r"mesh\[([^\]]*)\]", head).group(1)
  names, sizes = zip(*[(n, int(s)) for n, s in _MESH_AXIS.findall(mesh)])
  listed = re.search(r"device_ids=\((.*)\)", head)
  if listed is None:
    ids = np.arange(math.prod(sizes))
  elif _IOTA.match(listed.group(1)):
    ids = np.asarray(_iota_groups(listed.group(1)))
  else:
    ids = np.asarray(_ints(listed.group(1)))
  dims, grouped = [], []
  splits = {n: (int(p), int(s)) for n, p, s in _GROUP_AXIS.findall(axes.rstrip("}")) if n and p}
  wanted = [n for n, _, _ in _GROUP_AXIS.findall(axes.rstrip("}")) if n]
  for name, size in zip(names, sizes):
    if name in splits:
      pre, sub = splits[name]
      grouped.append(len(dims) + 1)
      dims += [pre, sub, size // (pre * sub)]
    else:
      if name in wanted:
        grouped.append(len(dims))
      dims.append(size)
  ids = ids.reshape(dims)
  rest = [d for d in range(len(dims)) if d not in grouped]
  size = math.prod(dims[d] for d in grouped)
  return ids.transpose(rest + grouped).reshape(-1, size).tolist()


def device_groups(text: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
  """The device groups of a collective instruction's `replica_groups` (every listed form: `{}`,
  explicit `{{0,1},{2,3}}`, iota `[2,4]<=[4,2]T(1,0)`, mesh axes `mesh['data'=8] {'data'}`);
  none listed: all `num_devices` in one group."""
  found = _GROUPS.search(text)
  if found is None or found.group(1) == "{}":
    return (tuple(range(num_devices)),)
  spec = found.group(1)
  if spec.startswith("{{"):
    groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", spec[1:-1])]
  elif spec.startswith("mesh"):
    groups = _mesh_groups(spec)
  else:
    groups = _iota_groups(spec)
  return tuple(tuple(g) for g in groups)


def _collective_of(module: Module, ins: Instruction) -> Collective | None:
  """The `Collective` an instruction starts (None if it is no collective)."""
  work = module.unwrap(ins) or ins
  kind = re.sub(r"-start$", "", work.opcode)
  if kind not in hlo.COLLECTIVE_KINDS:
    return None
  groups = device_groups(work.text, module.num_devices)
  operands = sum(nbytes(module.shapes.get(o, "")) for o in work.operands)
  size = operands * max(len(g) for g in groups) if kind == "all-gather" else operands
  listed = _PAIRS.search(work.text)
  pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", listed.group(1))) if listed else ()
  sync = ins.opcode == kind or '"is_sync":true' in ins.text
  return Collective(ins.name, kind, float(size), groups, sync, pairs)


def _fused_collectives(module: Module, ins: Instruction) -> list[Instruction]:
  """The collective instructions inside a fusion's computations (XLA:TPU fuses them)."""
  if ins.opcode != "fusion":
    return []
  return [i for i in module.called_instructions(ins) if re.sub(r"-start$", "", i.opcode) in hlo.COLLECTIVE_KINDS]


def program_collectives(module: Module) -> dict[str, Collective]:
  """{kernel name: `Collective`} of every collective kernel of an optimised HLO module (the ones
  `aot/hlo.kernels` lists: synchronous collectives, the `-start` halves, wrapped `async-start`s,
  and fusions holding one: a channel met again in a later fusion is the same collective, waited
  for at the last fusion that carries it)."""
  found, channels = {}, {}
  for kernel in hlo.kernels(module):
    ins = module.by_name[kernel.name]
    collective = _collective_of(module, ins)
    if collective is not None:
      found[kernel.name] = collective
    for inner in _fused_collectives(module, ins):
      channel = re.search(r"channel_id=(\d+)", inner.text)
      key = channel.group(1) if channel else inner.name
      if key in channels and channels[key] != kernel.name:
        found[channels[key]] = dataclasses.replace(found[channels[key]], sync=False, done=kernel.name)
      elif key not in channels and kernel.name not in found:
        channels[key] = kernel.name
        found[kernel.name] = dataclasses.replace(_collective_of(module, inner), name=kernel.name, sync=True)
  return found
