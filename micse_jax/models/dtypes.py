"""`model.dtype=auto`: the compute dtype per accelerator, a pure function of the device.

CPU → float32 (the reference); CUDA GPUs of compute capability < 8.0 (V100, T4: no bfloat16
units) → float16 with dynamic loss scaling (`training/precision.py`); CUDA ≥ 8.0 (A100,
H100, ...), GPUs without a compute capability (ROCm) and TPU → bfloat16.
"""
from __future__ import annotations

import jax

AUTO = "auto"
DTYPES = (AUTO, "float32", "bfloat16", "float16")  # `model.dtype`'s choices (config_checks reads this)


def auto_dtype(platform: str, compute_capability: str | None = None) -> str:
  """The compute dtype `model.dtype=auto` picks for a device (pure: testable without one).

  platform: `jax.Device.platform` ("cpu", "gpu"/"cuda"/"rocm", "tpu"); compute_capability:
  CUDA's "major.minor" (`jax.Device.compute_capability`), None where the device has none.
  CPU → float32; CUDA < 8.0 → float16 (no bfloat16 units); CUDA ≥ 8.0, GPUs without a
  compute capability (ROCm) and TPU → bfloat16.
  """
  platform = platform.lower()
  if platform == "cpu":
    return "float32"
  if platform in ("gpu", "cuda") and compute_capability:
    major = int(str(compute_capability).split(".")[0])
    return "float16" if major < 8 else "bfloat16"
  if platform in ("gpu", "cuda", "rocm", "tpu"):
    return "bfloat16"
  return "float32"  # an unknown backend: the safe choice


def device_dtype(device=None) -> str:
  """`auto_dtype` for `device` (default: this process's first device)."""
  device = device or jax.local_devices()[0]
  return auto_dtype(device.platform, getattr(device, "compute_capability", None))


def dtype_name(config, device=None) -> str:
  """`config.model.dtype`, with "auto" resolved for `device` (default: this process's first)."""
  name = config.model.dtype
  return device_dtype(device) if name == AUTO else name


