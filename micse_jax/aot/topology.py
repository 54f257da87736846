"""The devices of a GPU or TPU that is not here, for a deviceless compile, and their memory.

`jax.experimental.topologies.get_topology_desc` gives the devices of a GPU topology (from a
`GpuTargetConfigProto`, the shipped `aot/targets/*.txtpb`, sources in `aot/targets/README.md`;
up to `GPUS_PER_NODE` GPUs are one NVLink node, more are whole nodes of it joined by the
network) or of a TPU slice (libtpu; `tpu_slice` names the slice). They place shapes for `jax.jit(...).lower(...).compile()`, which then
runs the target's whole compiler on this CPU (no autotuning: XLA's default tiles); nothing runs
on them. Needs the optional extra `aot` (GPU: the jax-cuda13 plugin and PJRT wheels of the
installed jax) or `tpu` (libtpu).
"""
from __future__ import annotations

import importlib.resources
import importlib.util
import math
import re

from jax.experimental import topologies

from micse_jax import optional
from micse_jax.errors import ConfigError

GPU_TARGETS = {"h100": "h100.txtpb", "h200": "h200.txtpb", "a100": "a100.txtpb", "v100": "v100.txtpb"}
GPUS_PER_NODE = 8  # an HGX / DGX board: 8 GPUs on NVLink (NVSwitch; a V100 board's hybrid cube mesh)
TPU_TARGETS = {  # target -> (libtpu's chip name, slice shapes to pick the smallest that holds the devices)
    "tpu-v4": ("v4", ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4")),
    "tpu-v5e": ("v5e", ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
    "tpu-v5p": ("v5p", ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4")),
    "tpu-v6e": ("v6e", ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
}
TPU_CORES_PER_CHIP = {"tpu-v4": 2}  # libtpu's v4 devices are its two TensorCores; the others one device a chip
TARGETS = tuple(GPU_TARGETS) + tuple(TPU_TARGETS)


def gpu_target_config(target: str) -> str:
  """The shipped GpuTargetConfigProto text of a GPU target (`aot/targets/`, README there)."""
  return importlib.resources.files("micse_jax.aot").joinpath("targets", GPU_TARGETS[target]).read_text()


def device_memory_bytes(target: str) -> int | None:
  """A GPU target's device memory (its GpuTargetConfigProto's `device_memory_size`); None for a TPU
  target, whose deviceless topology does not give the chip's memory."""
  if target not in GPU_TARGETS:
    return None
  match = re.search(r"^\s*device_memory_size:\s*(\d+)", gpu_target_config(target), re.MULTILINE)
  return int(match.group(1)) if match else None


# The device memory `chunk_size=auto` (training/chunk_choice.py) sizes blocks for on a target that is not
# here, from the datasheets (binary GiB, as HBM is built): the V100 is the design's 16 GB part (its compiler
# target file describes the 32 GB SXM2), the TPUs' HBM per chip (Google Cloud's system architecture pages;
# v4's per TensorCore device, half a chip's 32 GiB).
DATASHEET_MEMORY_GIB = {"v100": 16, "a100": 80, "h100": 80, "h200": 141, "tpu-v4": 16, "tpu-v5e": 16,
                        "tpu-v5p": 95, "tpu-v6e": 32}
# libtpu's device kinds of the TPU targets
TPU_DEVICE_KINDS = {"tpu-v4": ("TPU v4",), "tpu-v5e": ("TPU v5 lite", "TPU v5e"), "tpu-v5p": ("TPU v5", "TPU v5p"),
                    "tpu-v6e": ("TPU v6 lite", "TPU v6e")}


def target_of(device) -> str | None:
  """The target (`TARGETS`) a device is, by its kind: a GPU's the target file's `device_description_str`
  (the V100's of either memory size), a TPU's libtpu's kind; None for any other."""
  kind = getattr(device, "device_kind", "")
  for target in GPU_TARGETS:
    match = re.search(r'device_description_str:\s*"([^"]*)"', gpu_target_config(target))
    if match and kind == match.group(1) or (target == "v100" and "V100" in kind):
      return target
  return next((t for t, kinds in TPU_DEVICE_KINDS.items() if kind in kinds), None)


def _require_cuda_plugin(target: str) -> None:
  """The CUDA plugin that compiles for `target`, at the installed jax's version: CUDA 13's (extra
  `aot`), or CUDA 12's (extra `aot-v100`), the only one for a V100 (CUDA 13's ptxas dropped sm_70)."""
  has_cuda13 = importlib.util.find_spec("jax_cuda13_plugin") is not None
  if target == "v100" and has_cuda13:  # both plugins claim the platform `cuda`; jax keeps CUDA 13's
    raise ConfigError("--aot v100 needs the CUDA 12 plugin without the CUDA 13 one (CUDA 13's ptxas compiles "
                      "nothing for sm_70): use an environment with pip install 'micse-jax[aot-v100]' (docs/AOT.md)")
  cuda = "13" if has_cuda13 else "12"
  optional.require(f"jax_cuda{cuda}_plugin", f"--aot {target}")
  for part in ("plugin", "pjrt"):
    optional.require_jax_match(f"jax-cuda{cuda}-{part}", f"--aot {target}")


def gpu_topology(num_devices: int) -> str:
  """The GPU topology of `num_devices` (XLA's "slices x hosts per slice x devices per host", a
  slice being one NVLink domain): one node of up to `GPUS_PER_NODE`, else whole nodes."""
  if num_devices <= GPUS_PER_NODE:
    return f"1x1x{num_devices}"
  if num_devices % GPUS_PER_NODE:
    raise ConfigError(f"--devices {num_devices} on a GPU target: up to {GPUS_PER_NODE} GPUs (one node) or a "
                      f"multiple of {GPUS_PER_NODE} (nodes of {GPUS_PER_NODE} joined by the network)")
  return f"{num_devices // GPUS_PER_NODE}x1x{GPUS_PER_NODE}"


def tpu_slice(target: str, num_devices: int) -> tuple[int, ...]:
  """The chip grid of the smallest slice of `target` in `TPU_TARGETS` that holds `num_devices`
  devices (a `ConfigError` when none does): what `target_devices` asks libtpu for."""
  chip, shapes = TPU_TARGETS[target]
  for shape in shapes:
    dims = tuple(int(d) for d in shape.split("x"))
    if math.prod(dims) * TPU_CORES_PER_CHIP.get(target, 1) >= num_devices:
      return dims
  raise ConfigError(f"--devices {num_devices} is more than the largest {target} slice here ({chip}:{shapes[-1]})")


def target_devices(target: str, num_devices: int = 1) -> list:
  """`num_devices` devices of a topology of `target`, for placing shapes (never for running)."""
  if target in GPU_TARGETS:
    _require_cuda_plugin(target)
    topo = topologies.get_topology_desc("aot", "cuda", target_config=gpu_target_config(target),
                                        topology=gpu_topology(num_devices))
    return list(topo.devices)[:num_devices]
  if target not in TPU_TARGETS:
    raise ConfigError(f"unknown --aot target {target!r}; expected one of {', '.join(TARGETS)}")
  optional.require("libtpu", f"--aot {target}")
  optional.require_jax_match("libtpu", f"--aot {target}")
  shape = "x".join(str(d) for d in tpu_slice(target, num_devices))
  return list(topologies.get_topology_desc(f"{TPU_TARGETS[target][0]}:{shape}", "tpu").devices)[:num_devices]


def datasheet_memory(device) -> tuple[int | None, str]:
  """(bytes a step may use on a deviceless target's `device`, where the figure comes from): its datasheet
  memory (`DATASHEET_MEMORY_GIB`), a GPU's at the share JAX's allocator would take of it
  (`training/chunk_choice.gpu_fraction`); (None, why) for a device of no target."""
  from micse_jax.training.chunk_choice import gpu_fraction
  target = target_of(device)
  if target is None:
    return None, f"no memory limit known for a {device.platform} device"
  gib = DATASHEET_MEMORY_GIB[target]
  if device.platform == "tpu":
    return gib * 2 ** 30, f"the {target} datasheet's {gib} GiB"
  fraction = gpu_fraction()
  return int(gib * 2 ** 30 * fraction), f"{fraction:.0%} of the {target} datasheet's {gib} GiB"
