"""What the host does for one call of a compiled GPU program, read from its optimised HLO (the time
model's host path, `aot/time_model.py`; priced by `training/dispatch.host_seconds`, which `auto`'s
choice of steps per call shares).

A call passes the entry computation's parameters and results (`entry_arrays`). XLA launches runs
of kernels as CUDA graphs (`graph_segments`): the kernels of one loop level, cut by each library
call where `mesh.cuda_graphs` keeps those out ("kernels"), a run of fewer than `MIN_GRAPH_KERNELS`
launched kernel by kernel. A program compiled without its GPU has no library calls; the ones its
autotuner would pick are estimated (`library_calls`). Constants and their sources: docs/AOT.md,
"The host".
"""
from __future__ import annotations

from micse_jax.aot.hlo_module import Module, arrays
from micse_jax.training import dispatch

MIN_GRAPH_KERNELS = 5             # XLA's `xla_gpu_graph_min_graph_size`: a shorter run of kernels is launched one by one
# A program compiled without its GPU (deviceless) was not autotuned: XLA keeps every GEMM a Triton
# fusion, where a GPU's autotuner hands some plain ones to cuBLAS (library calls, outside "kernels"
# graphs). The share it handed over in the calibrated batch-50 step (docs/AOT.md): 102 of its 166 plain GEMMs.
AUTOTUNED_LIBRARY_SHARE = 102 / 166


def library_calls(costs: list) -> list[bool]:
  """Whether each kernel runs as a library call on the GPU: a cuBLAS / cuDNN call, or, in a program
  that was not autotuned (no library call at all: a deviceless compile), every plain GEMM fusion the
  autotuner would hand over in expectation (`AUTOTUNED_LIBRARY_SHARE` of them, spread evenly)."""
  if any(c.library for c in costs):
    return [c.library for c in costs]
  marked, owed = [], 0.0
  for c in costs:
    owed += AUTOTUNED_LIBRARY_SHARE if c.plain_gemm else 0.0
    take = c.plain_gemm and owed >= 0.5
    owed -= 1.0 if take else 0.0
    marked.append(take)
  return marked


def graph_segments(costs: list, cuda_graphs: str | None) -> list[list[int]]:
  """The runs of consecutive kernels (their indices in `costs`) the host could launch as one CUDA
  graph, in program order: kernels of one loop level (a `while` is no graph node), split at each
  library call (`library_calls`) where those are kept out of the graphs (`cuda_graphs` "kernels");
  none without graphs ("none")."""
  if cuda_graphs == "none":
    return []
  segments, current, loop = [], [], None
  for i, (c, library) in enumerate(zip(costs, library_calls(costs))):
    breaks = library and cuda_graphs == "kernels"
    if breaks or c.loop != loop:
      segments.append(current)
      current, loop = [], c.loop
    if not breaks:
      current.append(i)
  segments.append(current)
  return [s for s in segments if s]


def work(costs: list, arrays: int, cuda_graphs: str | None, host_ahead: bool = True) -> dict:
  """What the host does for one call of a GPU program (priced by `seconds`): the `arrays`
  passed in and out; each CUDA graph (a `graph_segments` run of `MIN_GRAPH_KERNELS` or more) launched
  per run and updated once per call to the call's buffers ("fixed": XLA's command buffers keep fixed
  addresses and are never updated); every kernel of a shorter run, and each library call kept out of
  the graphs, launched per run; with library calls inside the graphs ("xla"), each captured again
  once per call when the host runs ahead of the device (`host_ahead`: the buffers then moved)."""
  library = library_calls(costs)
  graphs = [s for s in graph_segments(costs, cuda_graphs) if len(s) >= MIN_GRAPH_KERNELS]
  in_graphs = sum(len(s) * costs[s[0]].runs for s in graphs)
  captured = sum(library[i] for s in graphs for i in s)
  return {"arrays": arrays, "graph_updates": 0 if cuda_graphs == "fixed" else len(graphs),
          "graph_launches": sum(costs[s[0]].runs for s in graphs),
          "launches": sum(c.runs for c in costs) - in_graphs,
          "recaptures": captured if cuda_graphs == "xla" and host_ahead else 0,
          "library_calls_launched": sum(c.runs for c, is_library in zip(costs, library) if is_library) - sum(
              costs[i].runs for s in graphs for i in s if library[i])}


def seconds(work: dict) -> float:
  """The host's seconds for one call of a GPU program that does `work` (`dispatch.host_seconds`)."""
  return dispatch.host_seconds(work["arrays"], work["graph_updates"], work["graph_launches"], work["launches"],
                               work["recaptures"])


def entry_arrays(module: Module) -> int:
  """The arrays a call passes in and out: the entry computation's parameters and results."""
  body = module.computations.get(module.entry, ())
  params = sum(1 for ins in body if ins.opcode == "parameter")
  root = next((ins for ins in reversed(body) if ins.root), None)
  results = len(arrays(root.shape)) if root is not None else 0
  return params + results
