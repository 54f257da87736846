"""Mixed precision: the compute dtype, and dynamic loss scaling for float16 (via `jmp`).

Parameters and optimizer state always stay float32; `config.model.dtype` only sets the
dtype of the activations and matmuls. bfloat16 has float32's exponent range and needs no
loss scaling; float16 (V100, which has no bfloat16) does: small gradients underflow in its
5-bit exponent. Dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training")
multiplies the loss by a scale S before differentiation, divides the gradients by S, and

  * when the gradient norm ‖g‖₂ is finite (every gradient is, and their squares' sum does not
    overflow): applies the update; every `period` finite steps S ← 2S;
  * otherwise: skips the update (params, optimizer, EMA and queue untouched: `training/non_finite.py`)
    and S ← S/2.

The rule is `jmp.DynamicLossScale`; its state (scale, counter) plus a running count of the
skipped steps lives in `TrainState.loss_scale` as a plain dict, so it is checkpointed and
resumed with the rest of the state. Without float16 that field is `{}` and nothing changes.

`model.dtype="auto"` (the default) picks the dtype for the accelerator (`auto_dtype`): float32
on CPU, float16 + loss scaling on GPUs of compute capability < 8.0 (V100, T4: no bfloat16),
bfloat16 on Ampere and later GPUs and on TPU. The trainer resolves it once at start
(`with_resolved_dtype`), prints it once the input is checked, and writes the resolved name to config.json, so a resumed
run compares concrete dtypes (a float32 CPU workdir does not silently continue in bfloat16).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from micse_jax.errors import ConfigError
from micse_jax.models.dtypes import AUTO, DTYPES, auto_dtype, device_dtype, dtype_name  # noqa: F401 (re-export)
from micse_jax.optional import require

COMPUTE_DTYPES = {name: getattr(jnp, name) for name in DTYPES if name != AUTO}


def with_resolved_dtype(config, announce: bool = True, device=None):
  """A copy of `config` whose `model.dtype` is concrete: "auto" resolved for `device` (default: this
  process's first; the deviceless compile passes its target's). The one place "auto" is resolved: the
  trainer calls it at start, the deviceless compile for its target. Prints it once (`announce_dtype`)
  unless the caller does so later."""
  resolved = config.copy_and_resolve_references()
  with resolved.unlocked():
    resolved.model.dtype = dtype_name(config, device)
  if announce:
    announce_dtype(config.model.dtype, resolved.model.dtype)
  return resolved


def announce_dtype(requested: str, resolved: str) -> None:
  """Prints `dtype_line` (first process)."""
  if jax.process_index() == 0:
    print(dtype_line(requested, resolved), flush=True)


def dtype_line(requested: str, resolved: str) -> str:
  """The compute dtype and where it came from, in one line."""
  device = jax.local_devices()[0]
  origin = f"auto on {device.platform} {device.device_kind}" if requested == AUTO else "set"
  return f"compute dtype: {resolved} ({origin})"


def resolve_dtype(config) -> tuple:
  """(`with_resolved_dtype` of `config`, unprinted; its `dtype_line`, for the trainer to print once the
  run's input is checked)."""
  resolved = with_resolved_dtype(config, announce=False)
  return resolved, dtype_line(config.model.dtype, resolved.model.dtype)


def compute_dtype(name: str):
  """`config.model.dtype` → the jnp dtype of activations and matmuls ("auto": `device_dtype`)."""
  name = device_dtype() if name == AUTO else name
  if name not in COMPUTE_DTYPES:
    raise ConfigError(f"model.dtype {name!r} not supported; expected one of {sorted(COMPUTE_DTYPES)}")
  return COMPUTE_DTYPES[name]


def uses_loss_scaling(config) -> bool:
  """float16 needs dynamic loss scaling; float32 and bfloat16 do not ("auto" resolved first)."""
  return dtype_name(config) == "float16"


def initial_loss_scale_state(config) -> dict:
  """`TrainState.loss_scale` at step 0: `{}` unless float16."""
  if not uses_loss_scaling(config):
    return {}
  return {"scale": jnp.asarray(config.model.loss_scale_init, jnp.float32),
          "counter": jnp.zeros((), jnp.int32), "skipped_steps": jnp.zeros((), jnp.int32)}


def _jmp():
  """The `jmp` module (optional: only float16 training needs it)."""
  return require("jmp", "float16 training (model.dtype=float16, dynamic loss scaling)")


def _as_jmp(state: dict, period: int):
  return _jmp().DynamicLossScale(state["scale"], state["counter"], period=period, factor=2)


def value_and_unscaled_grad(loss_fn: Callable, state: dict, period: int) -> Callable:
  """Like `jax.value_and_grad(loss_fn, has_aux=True)`, differentiating S·loss, returning grads/S.

  With an empty `state` (no loss scaling) it is exactly `jax.value_and_grad`.
  """
  if not state:
    return jax.value_and_grad(loss_fn, has_aux=True)
  scale = _as_jmp(state, period)

  def scaled(*args):
    loss, aux = loss_fn(*args)
    return scale.scale(loss), (loss, aux)

  def run(*args):
    (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(*args)
    return (loss, aux), scale.unscale(grads)

  return run


def adjusted_loss_scale(state: dict, finite: jax.Array, period: int) -> tuple[dict, dict]:
  """The loss-scale state after a step whose gradients were `finite` (or not), by jmp's rule (S ← S/2
  on a non-finite step, S ← 2S after `period` finite ones), with a running count of the skipped
  steps; and its metrics: `loss_scale` (before the step), `skipped_steps` (running total, for
  TensorBoard) and `step_skipped` (0/1 for this step). Which state a skipped step keeps:
  `training/non_finite.py`."""
  adjusted = _as_jmp(state, period).adjust(finite)
  skipped = 1 - finite.astype(jnp.int32)
  new_state = {"scale": adjusted.loss_scale, "counter": adjusted.counter.astype(jnp.int32),
               "skipped_steps": state["skipped_steps"] + skipped}
  return new_state, {"loss_scale": state["scale"], "skipped_steps": new_state["skipped_steps"],
                     "step_skipped": skipped}
