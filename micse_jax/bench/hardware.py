"""Device facts for the benchmark: peak FLOP/s (for MFU) and peak memory."""
from __future__ import annotations

import resource

import jax

# Dense peak FLOP/s per device from the vendors' data sheets (SXM parts). "float32" is the
# TF32 tensor-core rate where XLA uses TF32 for float32 matmuls by default (A100, H100, H200);
# V100 has no TF32 and no bfloat16.
PEAK_FLOPS = {
    "V100": {"float16": 125e12, "float32": 15.7e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
}


def device_kind() -> str:
  """The first device's kind (e.g. 'cpu', 'NVIDIA H100 80GB HBM3')."""
  return jax.devices()[0].device_kind


def peak_flops(dtype: str) -> float | None:
  """The device's peak for `dtype`, or None (CPU, TPU, unknown GPU, unsupported dtype)."""
  kind = device_kind()
  for name, table in PEAK_FLOPS.items():
    if name in kind:
      return table.get(dtype)
  return None


def mfu(model_flops: float | None, step_seconds: float, dtype: str) -> float | None:
  """Model FLOP utilisation: the step's model FLOPs (training/flops.py) / step time / device peak."""
  peak = peak_flops(dtype)
  if not peak or not model_flops or model_flops != model_flops:
    return None
  return model_flops / step_seconds / peak


def peak_device_bytes() -> int | None:
  """Peak accelerator memory in use (None on CPU, whose backend keeps no statistics)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def peak_host_rss_bytes() -> int:
  """Peak resident memory of this process so far (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
