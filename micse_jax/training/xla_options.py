"""The XLA options the step is compiled with: what goes into its CUDA graphs (`mesh.cuda_graphs`)
and, with the state sharded, how far gradient reduce-scatters are combined."""

# With the state sharded, gradient reduce-scatters are combined up to this many gradient bytes only
# (each device writing 1/N of them: XLA's threshold counts those): XLA's default combines them into
# one large reduce-scatter late in the backward, exposed (BENCHMARKS.md).
REDUCE_SCATTER_COMBINE_BYTES = 64 * 2 ** 20
# What XLA records into the step's CUDA graphs and how it keeps them current, by `mesh.cuda_graphs`
# (`cuda_graphs_for`; XLA's options `xla_gpu_enable_command_buffer`, `xla_gpu_command_buffer_update_mode`).
# "kernels": XLA's own kernels and custom calls (ours) only, cuBLAS and cuDNN calls between the graphs;
# "xla": XLA's default set, library calls in the graphs too; "fixed": XLA's default set at fixed
# device addresses (XLA remaps the call's buffers under them), so no graph is ever updated nor a
# library call captured again; "none": no CUDA graphs, every kernel launched on its own.
CUDA_GRAPHS = {"kernels": {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL"}, "xla": {},
               "fixed": {"xla_gpu_command_buffer_update_mode": "NEVER_UPDATE"},
               "none": {"xla_gpu_enable_command_buffer": ""}}


def cuda_graphs_for(mode: str, ampere_or_newer: bool) -> str:
  """`mesh.cuda_graphs` resolved: "auto" is "kernels" on a GPU of compute capability >= 8.0 and
  "xla" on older ones, what the last A/B measured. XLA records a library call into a graph by stream
  capture and captures it again whenever one of its buffers moved, which they do every call once
  the host runs ahead of the GPU; a step as short as an Ampere-or-newer GPU's at batch 50 then
  waited for the host (measured on an H200, BENCHMARKS.md), while a V100's step outlasts the capture
  (the time model's `host_work`) and keeps its GEMMs in the graphs. "fixed" and "none" are choices to
  measure (the GPU kit's A/B points), not yet anyone's default."""
  if mode != "auto":
    return mode
  return "kernels" if ampere_or_newer else "xla"


def compiler_options(sharded: bool, platform: str, devices: int, cuda_graphs: str | None = "kernels") -> dict:
  """The XLA options the step is compiled with. On CUDA GPUs: what goes into its CUDA graphs
  (`CUDA_GRAPHS[cuda_graphs]`), and with the state sharded over `devices`, gradient reduce-scatters
  combined up to `REDUCE_SCATTER_COMBINE_BYTES` of gradients, so they start under the backward.
  None elsewhere."""
  if platform != "cuda":
    return {}
  options = dict(CUDA_GRAPHS[cuda_graphs])
  if sharded:
    options["xla_gpu_reduce_scatter_combine_threshold_bytes"] = REDUCE_SCATTER_COMBINE_BYTES // max(devices, 1)
  return options
