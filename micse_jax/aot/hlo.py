"""The kernels of a compiled XLA program, by kind and by phase of the train step, read from its HLO text.

`kernels(hlo_module.parse(compiled.as_text()))` lists every instruction that runs as its own
kernel (or launch): the instructions of the entry computation and of the computations it executes
(`while` bodies and conditions, `conditional` branches, `call`s such as a GPU command buffer / CUDA
graph), leaving out what is no work (parameters, constants, tuples, bitcasts, the `-done` halves of
asynchronous pairs) and the containers themselves. Fused computations are not walked: a fusion
is one kernel.

Each kernel gets

* a kind (`kind_of`): a GEMM by cuBLAS (`__cublas$gemm`, `__cublas$lt$matmul` custom calls), a
  Triton GEMM fusion (`__triton_gemm`), a Triton softmax / norm fusion (`__triton`), a cuDNN
  custom call or fusion (`__cudnn$...`: fused attention is `attention (cuDNN)`), XLA's loop /
  input (reduction) / output fusions (a TPU's matrix units work inside output fusions; a fusion
  holding a `dot` or `convolution` is a `matmul fusion`), sorts, copies, collectives, and any
  other unfused instruction under `unfused <opcode>`;
* a phase (`phase_of`): the first of the step's `jax.named_scope`s (`PHASES`,
  `training/step.py`) in the instruction's `op_name` metadata — or, for a fusion without one,
  the most common among its fused instructions. `jvp(scope)` is the forward pass of a scope
  inside the gradient, `transpose(jvp(scope))` its backward pass; they are reported as
  `scope (forward)` and `scope (backward)`. Instructions outside every scope (the step's key
  derivation, its metrics) are `(no phase)`.
"""
from __future__ import annotations

import collections
import dataclasses
import re

from micse_jax.aot.hlo_module import NO_WORK, Instruction, Module

PHASES = ("views", "encode", "loss/contrastive", "loss/ami", "loss/reconstruction", "loss/mlm", "loss/infocse",
          "optimizer", "momentum_forward", "enqueue", "finite")
# the update (clipping, AdamW, the EMA and the weight copies in one pass: training/update.py) and the
# non-finite selection after it (training/non_finite.py)
UPDATE_PHASES = ("optimizer", "finite")
NO_PHASE = "(no phase)"
COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_CONTAINERS = {"while", "call", "conditional"}
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PHASE = re.compile(r"(?:^|[/(])(transpose\()?(?:jvp\()?(" + "|".join(re.escape(p) for p in PHASES) +
                    r")(?=[)/]|$)")


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of the compiled program: the top-level instruction's name, its kind, its phase, how
  many times one call runs it (`runs`: the trip counts of the `while` loops around it, `trip_count`) and the
  innermost of those loops (`loop`, None at the entry's level)."""
  name: str
  kind: str
  phase: str
  runs: int = 1
  loop: str | None = None


def phase_of(op_name: str | None) -> str | None:
  """`scope`, `scope (forward)` / `scope (backward)` (inside the gradient), or None."""
  match = _PHASE.search(op_name or "")
  if match is None:
    return None
  scope = match.group(2)
  if match.group(1):
    return f"{scope} (backward)"
  return f"{scope} (forward)" if "jvp(" in match.group(0) else scope


def _custom_call_kind(text: str) -> str:
  target = re.search(r'custom_call_target="([^"]*)"', text)
  target = target.group(1) if target else ""
  if target.startswith("__cublas"):
    return "GEMM (cuBLAS)"
  if target.startswith("__cudnn$fmha") or "fmha" in target:
    return "attention (cuDNN)"
  if target.startswith("__cudnn"):
    return "cuDNN custom call"
  return f"custom call ({target or '?'})"


def kind_of(ins: Instruction, module: Module) -> str:
  """The kernel kind of one instruction (see the module docstring)."""
  op, text = ins.opcode, ins.text
  if op == "custom-call":
    return _custom_call_kind(text)
  if op == "fusion":
    backend = re.search(r'"kind":"([^"]*)"', text)
    backend = backend.group(1) if backend else ""
    if backend == "__triton_gemm" or "gemm" in backend:
      return "GEMM (Triton fusion)"
    if backend.startswith("__triton"):
      return "Triton softmax/norm fusion"
    if backend.startswith("__cudnn"):
      return "cuDNN fusion"
    if backend:
      return f"custom fusion ({backend})"
    fused = {i.opcode for i in module.called_instructions(ins)}
    if fused & {"dot", "convolution"}:
      return "matmul fusion"
    if "sort" in fused:
      return "sort"
    kind = re.search(r"kind=k(\w+)", text)
    return f"{kind.group(1).lower() if kind else 'loop'} fusion"
  if op in ("sort",):
    return "sort"
  if op in ("copy", "copy-start"):
    return "copy"
  if op in ("dot", "convolution"):
    return "matmul (unfused)"
  base = re.sub(r"-start$", "", op)
  if base in COLLECTIVE_KINDS:
    return f"collective ({base})"
  return f"unfused {op}"


def _fused_phase(ins: Instruction, module: Module) -> str:
  """The instruction's own phase, else the most common phase of what it fuses."""
  own = phase_of(ins.op_name())
  if own:
    return own
  votes = collections.Counter(phase_of(i.op_name()) for i in module.called_instructions(ins))
  votes.pop(None, None)
  return votes.most_common(1)[0][0] if votes else NO_PHASE


def trip_count(ins: Instruction, module: Module | None = None) -> int:
  """How many times a `while` runs its body: XLA's `known_trip_count` (XLA:GPU writes it), else, in
  `module`, the counted loop's own bounds (`counted_trips`; XLA:TPU writes no annotation); 1 when
  unknown."""
  match = _TRIP_COUNT.search(ins.text)
  if match:
    return int(match.group(1))
  counted = counted_trips(ins, module) if module is not None else None
  return 1 if counted is None else counted


_PASS_THROUGH = ("copy", "bitcast", "convert")


def _source(module: Module, name: str) -> Instruction | None:
  """The instruction behind `name`, through copies, bitcasts and converts."""
  ins = module.by_name.get(name)
  while ins is not None and ins.opcode in _PASS_THROUGH and ins.operands:
    ins = module.by_name.get(ins.operands[0])
  return ins


def _integer_constant(ins: Instruction | None) -> int | None:
  match = re.search(r"\bconstant\((-?\d+)\)", ins.text) if ins is not None and ins.opcode == "constant" else None
  return int(match.group(1)) if match else None


def counted_trips(ins: Instruction, module: Module) -> int | None:
  """The trips of a counted `while` (a `scan` or `fori_loop`: its counter starts at a constant and
  steps by one) from its bounds: the condition's root compares a carried element with a constant
  (`i < N`, or `N > i`), whose initial value is a constant c: N − c. None for any other loop."""
  condition = re.search(r"\bcondition=%?([\w.\-]+)", ins.text)
  body = module.computations.get(condition.group(1), ()) if condition else ()
  root = next((i for i in body if i.root), None)
  direction = re.search(r"direction=(\w+)", root.text) if root is not None and root.opcode == "compare" else None
  if direction is None or direction.group(1) not in ("LT", "GT") or len(root.operands) != 2 or not ins.operands:
    return None
  counter, bound = root.operands if direction.group(1) == "LT" else root.operands[::-1]
  counter, limit = _source(module, counter), _integer_constant(_source(module, bound))
  index = re.search(r"\bindex=(\d+)", counter.text) if counter is not None and counter.opcode == "get-tuple-element" \
      else None
  start = module.by_name.get(ins.operands[0])
  if index is None or limit is None or start is None or start.opcode != "tuple" or \
      int(index.group(1)) >= len(start.operands):
    return None
  first = _integer_constant(_source(module, start.operands[int(index.group(1))]))
  return None if first is None else max(limit - first, 0)


def scheduled_runs(module: Module):
  """(instruction, runs, loop) for each instruction the entry computation executes, in program order
  (a scheduled module's order): the computations it runs (`while` bodies and conditions, branches,
  `call`s such as a command buffer) walked in place, each once, `runs` the product of the trip counts
  of the loops around it, `loop` the innermost of them (None outside any); the containers themselves
  left out."""
  seen = set()

  def walk(name: str, runs: int, loop: str | None):
    if name in seen:
      return
    seen.add(name)
    for ins in module.computations.get(name, ()):
      if ins.opcode in _CONTAINERS:
        inner, level = (runs * trip_count(ins, module), ins.name) if ins.opcode == "while" else (runs, loop)
        for called in ins.called():
          yield from walk(called, inner, level)
      else:
        yield ins, runs, loop

  return walk(module.entry, 1, None) if module.entry is not None else iter(())


def scheduled(module: Module):
  """The instructions of `scheduled_runs`, without their runs and loops."""
  return (ins for ins, _, _ in scheduled_runs(module))


def steps_per_call(module: Module) -> int:
  """The training steps one call of a program runs: the trip count of the entry computation's loop
  whose body holds the most instructions (the step, `training/chunk_loop.repeated`), 1 without one."""
  loops = [ins for ins in module.computations.get(module.entry, ()) if ins.opcode == "while"]
  size = lambda ins: len(module.called_instructions(ins))
  return trip_count(max(loops, key=size), module) if loops else 1


def kernels(module: Module) -> list[Kernel]:
  """The kernels of an optimised HLO module (see the module docstring), in program order; an
  `async-start` is the kernel of the instruction it wraps (`Module.unwrap`)."""
  found = []
  for ins, runs, loop in scheduled_runs(module):
    if ins.opcode in NO_WORK or ins.opcode.endswith(("-done", "-update")):
      continue
    work = module.unwrap(ins)
    if work is not None:
      found.append(Kernel(ins.name, kind_of(work, module), _fused_phase(work, module), runs, loop))
  return found


def summary(module: Module) -> dict:
  """{'kernels_per_step', 'by_kind', 'by_phase', 'update_kernels_per_step', 'update_by_kind',
  'by_phase_and_kind', 'steps_per_call'} of an optimised HLO module: launches per training step (a
  call of K steps launches the loop's kernels K times: `Kernel.runs`, divided by K)."""
  found = kernels(module)
  steps = steps_per_call(module)
  per_step = lambda n: int(n) if n == int(n) else round(n, 1)
  update = [k for k in found if k.phase in UPDATE_PHASES]
  by_phase_kind = collections.defaultdict(collections.Counter)
  for k in found:
    by_phase_kind[k.phase][k.kind] += k.runs
  def count(ks, attr):
    totals = collections.Counter()
    for k in ks:
      totals[getattr(k, attr)] += k.runs
    return {key: per_step(n / steps) for key, n in totals.most_common()}
  return {"kernels_per_step": per_step(sum(k.runs for k in found) / steps), "by_kind": count(found, "kind"),
          "by_phase": count(found, "phase"), "update_kernels_per_step": per_step(sum(k.runs for k in update) / steps),
          "update_by_kind": count(update, "kind"), "steps_per_call": steps,
          "by_phase_and_kind": {p: {key: per_step(n / steps) for key, n in c.most_common()}
                                for p, c in by_phase_kind.items()}}


# What only one XLA backend writes into an optimised module: its backend configs' own fields, its
# library calls, a TPU's tiled layouts (`{1,0:T(8,128)}`). A module with none of them (hand-written, or
# a program with nothing but copies) is of no known platform.
_PLATFORM_MARKS = (
    ("tpu", re.compile(r"\{[\d,]*:T\(\d")),
    ("gpu", re.compile(r'"operation_queue_id"|"fusion_backend_config"|custom_call_target="__(?:cublas|cudnn|gpu)')),
    ("cpu", re.compile(r'"outer_dimension_partitions"|"__ynn_fusion"|custom_call_target="__onednn')))


def compiled_for(hlo_text: str) -> str | None:
  """The platform ("gpu", "tpu", "cpu") an optimised module was compiled for, by what only that XLA
  backend writes into it (`_PLATFORM_MARKS`); None when nothing in it says."""
  return next((platform for platform, mark in _PLATFORM_MARKS if mark.search(hlo_text)), None)


def phase_by_instruction(module: Module) -> dict[str, str]:
  """{kernel (instruction) name: phase}: the key that maps a profile's op or kernel events to phases."""
  return {k.name: k.phase for k in kernels(module)}
