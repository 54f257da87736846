"""What each kernel of a compiled XLA program moves and computes, read from its optimised HLO text.

`costs(hlo_module.parse(hlo_text))` gives, for every kernel of `hlo.kernels` (the program's
kernel-launching instructions, in program order), a `Cost`:

* `read` / `written` bytes: only what the kernel really touches. A fusion is walked back from its
  outputs, each instruction asking its operands for the elements it needs (`_demands`: a slice,
  dynamic-slice or gather its part, slices of one value adding up; elementwise users of one value
  read it once; a broadcast its operand once; a reduction, a dot or a nested fusion everything); the
  target of an in-place dynamic-update-slice or scatter is not read, only the update written. A
  cuBLAS / cuDNN call reads its operands and writes its first result (not the `s8[...]` workspace);
  a Pallas (Triton) call reads each distinct operand once.
* `flops`: 2·M·N·K of each `dot` (in a fusion, nested fusions included, or a cuBLAS call's
  `dot_dimension_numbers`): 2 × the output's elements × the contracted size.
* `rounds`: threefry-2x32 rounds computed inline: one 32-bit rotation (`or` of a `shift-left`
  and a `shift-right-logical`) per round and element (a hash is 20 rounds, `ROUNDS_PER_HASH`).
* our own Pallas kernels, whose insides the HLO does not show, by their name (`_PALLAS_WORK`) and
  first output's shape (`kernels/dropout_attention.py`): the forward 4·d FLOPs and one threefry hash
  per probability, the backward 10·d FLOPs per probability, its keep mask read (a sown layer's also
  write and read float32 probabilities: bytes, the same work); each writes all its results and is
  timed as priced times what it measured against that price on a GPU (`MEASURED_FACTOR`).
* `dtype`: the GEMM's operand element type (its peak rate), `tf32` for a float32 dot at the
  default precision, `f32` at `HIGHEST`;
* traits the time model times differently: a reduction, a column reduction into few outputs, a
  wide concatenate written out, a sort's shared-memory traffic, a scatter's atomic updates.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import re

from micse_jax.aot import hlo
from micse_jax.aot.hlo_module import Instruction, Module, array_bytes, arrays, nbytes

ROUNDS_PER_HASH = 20  # threefry-2x32 (Salmon et al. 2011): 20 rounds of add, rotate, xor
_SLICES = {"slice", "dynamic-slice", "gather"}
_FREE = {"bitcast", "reshape", "get-tuple-element"}  # views: their users are the parameter's users
_PLAIN_GEMM = {"dot", "parameter", "bitcast"}  # a fusion of these alone is a plain GEMM


@dataclasses.dataclass(frozen=True)
class Cost:
  """One kernel's traffic and work (see the module docstring)."""
  name: str
  kind: str
  phase: str
  read: float = 0.0
  written: float = 0.0
  flops: float = 0.0
  rounds: float = 0.0
  dtype: str = ""
  reduces: bool = False        # it holds a reduction (reductions stream memory less well)
  narrow_columns: bool = False  # a reduction over major dimensions into <= NARROW outputs (few blocks)
  concat_operands: int = 0     # operands of a concatenate it writes out
  sort_traffic: float = 0.0    # bytes a bitonic sort moves through shared memory (see `_sort_traffic`)
  atomic_updates: float = 0.0  # scatter-add update elements (atomics)
  atomic_chain: float = 0.0    # updates per target element: atomics to one address run one after another
  measured_factor: float = 1.0  # one of our Pallas kernels: its measured time over this model's price
  library: bool = False        # a cuBLAS / cuDNN call (XLA records it into a CUDA graph by stream capture)
  runs: int = 1                # launches per call of the program (the trip counts of the loops around it)
  loop: str | None = None      # the innermost `while` around it (None at the entry's level)
  plain_gemm: bool = False     # a GEMM fusion that is a dot alone (a GPU's autotuner may hand it to cuBLAS)

  @property
  def bytes(self) -> float:
    """Bytes read and written."""
    return self.read + self.written


_FULL = {"dot", "convolution", "sort", "fusion", "custom-call", "fft", "triangular-solve", "cholesky", "while",
         "call", "conditional", "rng-bit-generator", "all-reduce", "all-gather", "reduce-scatter"}


def _elements(module: Module, name: str) -> float:
  return float(sum(math.prod(d) for _, d in arrays(module.shapes.get(name, ""))))


def _in_place_target(module: Module, name: str, params: set[str]) -> bool:
  """Whether `name` is (a view of) a parameter: an in-place update's target then needs no read."""
  while name not in params and name in module.by_name and module.by_name[name].opcode in _FREE:
    name = module.by_name[name].operands[0]
  return name in params


def _operand_demand(module: Module, user: Instruction, position: int, demand: float,
                    params: set[str]) -> float:
  """Elements of operand `position` that `user` reads when `demand` of its own elements are used."""
  name = user.operands[position]
  n_operand, n_user, op = _elements(module, name), max(_elements(module, user.name), 1.0), user.opcode
  if demand <= 0 or op in ("iota", "constant", "parameter"):
    return 0.0
  if op in _FULL:
    return n_operand
  if op in ("reduce", "reduce-window"):
    return n_operand * demand / n_user if position < len(user.operands) // 2 else n_operand
  if op == "concatenate":
    return min(n_operand, demand * n_operand / n_user)
  if op in ("dynamic-update-slice", "scatter") and position == 0:
    return 0.0 if _in_place_target(module, name, params) else n_operand
  if op == "broadcast":
    return max(1.0, n_operand * demand / n_user)
  return min(n_operand, demand)  # elementwise, views, slices, gathers: what is used


def _demands(module: Module, body: list[Instruction], params: set[str]) -> dict[str, float]:
  """{instruction: elements of it that the fusion's outputs need}, walked from the root back
  (the text lists every instruction after its operands)."""
  aligned, regions = collections.defaultdict(float), collections.defaultdict(float)
  root = next((i for i in body if i.root), body[-1] if body else None)
  if root is None:
    return aligned
  for name in root.operands if root.opcode == "tuple" else [root.name]:
    aligned[name] = _elements(module, name)
  demand = {}
  for ins in reversed(body):
    if ins.opcode == "tuple" or (ins.name not in aligned and ins.name not in regions):
      continue
    demand[ins.name] = min(_elements(module, ins.name), max(aligned[ins.name], regions[ins.name]))
    for position, name in enumerate(ins.operands):
      need = _operand_demand(module, ins, position, demand[ins.name], params)
      if ins.opcode in _SLICES:  # slices cover different parts: they add up
        regions[name] += need
      else:  # elementwise users read the same elements
        aligned[name] = max(aligned[name], need)
  for name in set(aligned) | set(regions):
    demand.setdefault(name, min(_elements(module, name), max(aligned[name], regions[name])))
  return demand


def _written(module: Module, body: list[Instruction], params: set[str]) -> float:
  """Bytes the fusion writes: its outputs, an in-place update's target only where updated."""
  root = next((i for i in body if i.root), None)
  if root is None:
    return 0.0
  written = 0.0
  for out in ([module.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]):
    ops = out.operands
    if out.opcode in ("dynamic-update-slice", "scatter") and _in_place_target(module, ops[0], params):
      written += nbytes(module.shapes[ops[1 if out.opcode == "dynamic-update-slice" else 2]])
    else:
      written += nbytes(module.shapes[out.name])
  return written


def _dot_flops(module: Module, ins: Instruction) -> tuple[float, str]:
  """(2 × output elements × contracted size, operand type) of a `dot`, or of a `convolution`
  (a TPU's matmuls: the kernel's input-feature and spatial sizes, from `dim_labels`)."""
  lhs, rhs = (list(ins.operands) + ["", ""])[:2]
  (dtype, dims), = arrays(module.shapes.get(lhs, ""))[:1] or [("f32", ())]
  if ins.opcode == "convolution":
    k = _convolution_taps(ins, arrays(module.shapes.get(rhs, ""))[:1])
  else:
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.text)
    k = math.prod(dims[int(d)] for d in contracting.group(1).split(",") if d) if contracting else 1
  out = sum(math.prod(d) for _, d in arrays(module.shapes[ins.name]))
  if dtype == "f32":
    dtype = "f32" if "HIGHEST" in ins.text else "tf32"
  return 2.0 * out * k, dtype


def _convolution_taps(ins: Instruction, kernel) -> int:
  """Multiply-adds per output element of a convolution: the kernel's input features times its
  spatial taps that land on real input elements. XLA:TPU writes a batched matmul's batch dimensions
  as a window as large as the batch with the input dilated by as much (`lhs_dilate`): one tap each."""
  labels = re.search(r"dim_labels=\w*_(\w+)->", ins.text)
  if not labels or not kernel:
    return 1
  dilation = re.search(r"lhs_dilate=([\dx]+)", ins.text)
  dilations = iter(int(d) for d in dilation.group(1).split("x")) if dilation else None
  taps = 1
  for label, size in zip(labels.group(1), kernel[0][1]):
    if label == "i":
      taps *= size
    elif label.isdigit():
      taps *= -(-size // next(dilations)) if dilations else size
  return taps


def _is_rotation(module: Module, ins: Instruction) -> bool:
  """A 32-bit rotation: an `or` of a `shift-left` and a `shift-right-logical` (one per threefry round)."""
  if ins.opcode != "or" or not module.shapes[ins.name].startswith("u32"):
    return False
  return {module.by_name[o].opcode for o in ins.operands if o in module.by_name} == {
      "shift-left", "shift-right-logical"}


def _work(module: Module, computation: str, demand: dict[str, float], seen: set[str]) -> tuple[float, float, str]:
  """(flops, threefry rounds, GEMM dtype) of a fused computation and the fusions nested in it;
  rounds counted on the elements that the outputs need."""
  flops, rounds, dtype = 0.0, 0.0, ""
  if computation in seen:
    return flops, rounds, dtype
  seen.add(computation)
  for ins in module.computations.get(computation, ()):
    if ins.opcode in ("dot", "convolution"):
      f, dtype = _dot_flops(module, ins)
      flops += f
    elif ins.opcode == "fusion":
      f, r, d = _work(module, module.fused(ins) or "", collections.defaultdict(lambda: float("inf")), seen)
      flops, rounds, dtype = flops + f, rounds + r, dtype or d
    elif _is_rotation(module, ins):
      rounds += min(_elements(module, ins.name), demand.get(ins.name, 0.0))
  return flops, rounds, dtype


def _sort_traffic(module: Module, ins: Instruction) -> float:
  """Bytes a `sort` moves through shared memory: a bitonic sort of n (rounded up to a power of two)
  runs log2(n)·(log2(n)+1)/2 compare-exchange stages, each reading and writing every element's
  keys and values."""
  dims = re.search(r"dimensions=\{(\d+)\}", ins.text)
  shapes = [arrays(module.shapes[o])[0] for o in ins.operands if arrays(module.shapes.get(o, ""))]
  if not shapes:
    return 0.0
  n = shapes[0][1][int(dims.group(1))] if dims and shapes[0][1] else 1
  log_n = max(1, math.ceil(math.log2(max(n, 2))))
  elements = math.prod(shapes[0][1])
  return 2.0 * elements * log_n * (log_n + 1) / 2 * array_bytes([(t, ()) for t, _ in shapes])


NARROW = 16384  # outputs of a column reduction below which XLA gives it too few blocks to fill the memory system


def _narrow_columns(module: Module, ins: Instruction) -> bool:
  """A `reduce` that keeps its input's minor (fastest-varying) dimension and has <= NARROW outputs."""
  shape = module.shapes.get(ins.operands[0], "")
  layout = re.search(r"\[([\d,]*)\]\{([\d,]*)", shape)
  rank = len(arrays(shape)[0][1]) if arrays(shape) else 0
  minor = int(layout.group(2).split(",")[0]) if layout and layout.group(2) else rank - 1
  reduced = re.search(r"dimensions=\{([\d,]*)\}", ins.text)
  dims = {int(d) for d in reduced.group(1).split(",") if d} if reduced else set()
  return minor not in dims and _elements(module, ins.name) <= NARROW


def _traits(module: Module, body: list[Instruction]) -> dict:
  """The fused computation's reductions, widest concatenate, sort traffic and scatter atomics."""
  root = next((i for i in body if i.root), None)
  outputs = [module.by_name[o] for o in root.operands] if root is not None and root.opcode == "tuple" else [root]
  traits = {"reduces": any(i.opcode in ("reduce", "reduce-window") for i in body),
            "plain_gemm": any(i.opcode == "dot" for i in body) and all(i.opcode in _PLAIN_GEMM for i in body),
            "narrow_columns": any(_narrow_columns(module, i) for i in body if i.opcode == "reduce"),
            "concat_operands": max((len(i.operands) for i in outputs if i is not None and i.opcode == "concatenate"),
                                   default=0),
            "sort_traffic": sum(_sort_traffic(module, i) for i in body if i.opcode == "sort")}
  for i in body:
    if i.opcode == "scatter":
      ops = i.operands
      updates, target = _elements(module, ops[2]), max(_elements(module, ops[0]), 1.0)
      traits["atomic_updates"] = traits.get("atomic_updates", 0.0) + updates
      traits["atomic_chain"] = max(traits.get("atomic_chain", 0.0), updates / target)
  return traits


def fusion_cost(module: Module, ins: Instruction, kernel: hlo.Kernel) -> Cost:
  """The cost of one fusion kernel (see the module docstring)."""
  computation = module.fused(ins) or ""
  body = module.computations.get(computation, [])
  params = {p.name for p in body if p.opcode == "parameter"}
  demand = _demands(module, body, params)
  read = sum(demand.get(p, 0.0) * nbytes(module.shapes[p]) / max(_elements(module, p), 1.0) for p in params)
  flops, rounds, dtype = _work(module, computation, demand, set())
  return Cost(kernel.name, kernel.kind, kernel.phase, read, _written(module, body, params), flops, rounds, dtype,
              **_traits(module, body))


# Measured time over this model's price of each dropout-attention kernel, from the H200 calibration
# point docs/calibration/h200-2026-11-27-7843083 (the times: BENCHMARKS.md): the backward's five
# dependent tile GEMMs per (sentence, head) run far below the GEMM rate its FLOPs are priced at.
MEASURED_FACTOR = {"forward": 1.0, "forward_keep": 1.30, "backward": 2.13}


def _dropout_attention_work(heads: int, outputs: list[tuple[str, tuple[int, ...]]], backward: bool = False
                            ) -> tuple[float, float, str, float]:
  """(FLOPs, threefry rounds, GEMM dtype, `MEASURED_FACTOR`) of the dropout-attention kernels from their
  outputs, the first `[.., T, heads·d]` (forward: the context; then the keep mask, a sown layer's probabilities) or
  `[.., T, 3·heads·d]` (backward: d projection)."""
  dtype, dims = outputs[0]
  length, head_dim = dims[-2], dims[-1] // (heads * (3 if backward else 1))
  probabilities = math.prod(dims[:-1]) * heads * length
  if backward:
    return 10.0 * probabilities * head_dim, 0.0, dtype, MEASURED_FACTOR["backward"]
  factor = MEASURED_FACTOR["forward_keep" if len(outputs) > 1 else "forward"]
  return 4.0 * probabilities * head_dim, float(probabilities * ROUNDS_PER_HASH), dtype, factor


_PALLAS_WORK = {re.compile(r"micse_dropout_attention_h(\d+)"): _dropout_attention_work,
                re.compile(r"micse_dropout_attention_backward_h(\d+)"):
                    lambda heads, outputs: _dropout_attention_work(heads, outputs, backward=True)}


def _pallas_work(ins: Instruction, outputs) -> tuple[float, float, str, float]:
  """(FLOPs, rounds, dtype, measured factor) of one of our named Pallas kernels; no work for any other call."""
  for pattern, work in _PALLAS_WORK.items():
    found = pattern.search(ins.text)
    if found and outputs:
      return work(int(found.group(1)), outputs)
  return 0.0, 0.0, "", 1.0


def custom_call_cost(module: Module, ins: Instruction, kernel: hlo.Kernel) -> Cost:
  """A library call: operands read whole, the first result written; a GEMM's FLOPs from its
  `dot_dimension_numbers` (cuBLAS) and operand shapes; a Pallas (Triton) call's distinct operands
  read once, its work from its name (`_pallas_work`)."""
  ops = ins.operands
  pallas = "__gpu$xla.gpu.triton" in ins.text
  read = sum(nbytes(module.shapes.get(o, "")) for o in (dict.fromkeys(ops) if pallas else ops))
  results = arrays(module.shapes[ins.name])
  result = results if pallas else [a for a in results if a[0] != "s8"][:1] or results[:1]
  written = array_bytes(result)
  flops, dtype = 0.0, ""
  config = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', ins.text)
  if config and ops:
    numbers = json.loads(config.group(1))
    (dtype, dims), = arrays(module.shapes[ops[0]])[:1]
    k = math.prod(dims[int(d)] for d in numbers.get("lhs_contracting_dimensions", []))
    flops = 2.0 * sum(math.prod(d) for _, d in result) * k
    if dtype == "f32":
      dtype = "f32" if "HIGHEST" in ins.text else "tf32"
  rounds, factor = 0.0, 1.0
  if pallas:
    flops, rounds, dtype, factor = _pallas_work(ins, result)
  return Cost(kernel.name, kernel.kind, kernel.phase, read, written, flops, rounds, dtype, measured_factor=factor,
              library=bool(re.search(r'custom_call_target="__(cublas|cudnn)', ins.text)))


def plain_cost(module: Module, ins: Instruction, kernel: hlo.Kernel) -> Cost:
  """Any other kernel (copy, sort, collective, an unfused op): operands read, result written."""
  read = sum(nbytes(module.shapes.get(o, "")) for o in ins.operands)
  return Cost(kernel.name, kernel.kind, kernel.phase, read, nbytes(module.shapes[ins.name]),
              **_traits(module, [ins]))


def costs(module: Module) -> list[Cost]:
  """The `Cost` of every kernel of an optimised HLO module, in program order (each launch's; a kernel
  in a loop runs `Cost.runs` times per call)."""
  found = []
  for kernel in hlo.kernels(module):
    ins = module.unwrap(module.by_name[kernel.name])  # an async-start: the wrapped instruction does the work
    if ins.opcode == "fusion":
      cost = fusion_cost(module, ins, kernel)
    elif ins.opcode == "custom-call":
      cost = custom_call_cost(module, ins, kernel)
    else:
      cost = plain_cost(module, ins, kernel)
    found.append(dataclasses.replace(cost, runs=kernel.runs, loop=kernel.loop))
  return found
