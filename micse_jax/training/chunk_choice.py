"""`chunk_size=auto`: the largest GradCache block (`training/grad_cache.py`) whose compiled step fits the
device's memory, by the compiled program's own figures.

The blocks a batch can be cut into (`block_sizes`): the whole padded batch first (the unblocked step,
`chunk_size` 0), then every divisor of its rows that is a multiple of the devices the rows are split over
(each device cuts its own rows), largest first. Each try is a compile of the whole step (`program.build`
at that `chunk_size`, `program.compiled`), its peak the compiler's (`aot/compile.memory`: arguments +
outputs − aliased + temporaries per device, what `compiled.memory_analysis()` says), against the device's
memory (`memory_limit`). A step's peak grows about linearly with its block's rows (a block's activations
over the state's fixed bytes), so a try that does not fit skips the sizes a line through the tries says
cannot fit either, and a fit below sizes not tried is checked upwards (`choose`): a few compiles, not one
per divisor. None fitting is one `ConfigError`, raised while the program is built, before the trainer
writes anything.

The memory: a GPU's own allocator limit (`device.memory_stats()["bytes_limit"]`, JAX's
`XLA_PYTHON_CLIENT_MEM_FRACTION` of the card); a device that is not here (a deviceless `--aot` target,
`aot/topology.py`) its datasheet memory, a GPU's at the same fraction JAX would give it there; a CPU none
known, so the whole batch.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable

import ml_collections

from micse_jax.errors import ConfigError

AUTO = "auto"
WHOLE = "0"
# JAX's default `XLA_PYTHON_CLIENT_MEM_FRACTION`: the share of a GPU's memory its allocator takes
GPU_CLIENT_FRACTION = 0.75


def is_auto(config: ml_collections.ConfigDict) -> bool:
  """Whether `chunk_size` is "auto" (to be resolved before the step is built)."""
  return str(config.get("chunk_size", WHOLE)).strip() == AUTO


def block_sizes(rows: int, row_devices: int) -> list[int]:
  """The block sizes to try, largest first: `rows` (the whole batch), then each divisor of `rows` that is
  a multiple of `row_devices`."""
  return [rows] + [d for d in range(rows - 1, 0, -1) if rows % d == 0 and d % row_devices == 0]


def gpu_fraction() -> float:
  """The share of a GPU's memory JAX's allocator would take (`XLA_PYTHON_CLIENT_MEM_FRACTION`)."""
  try:
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_CLIENT_FRACTION))
  except ValueError:
    return GPU_CLIENT_FRACTION


class _Deviceless(threading.local):
  stack: list  # the datasheet readers in effect, innermost last (per thread: tracing runs on the caller's)

  def __init__(self):
    self.stack = []


_deviceless = _Deviceless()


@contextlib.contextmanager
def deviceless_memory(limit_of: Callable):
  """`limit_of(device) -> (bytes | None, source)` in effect for the devices that have no allocator to ask
  (a deviceless compile's: `aot/topology.datasheet_memory`, set by `aot/compile.build_program`)."""
  _deviceless.stack.append(limit_of)
  try:
    yield
  finally:
    _deviceless.stack.pop()


def memory_limit(device) -> tuple[int | None, str]:
  """(bytes a step may use on `device`, where the figure comes from); (None, why) where none is known
  (a CPU). A device here: its allocator's limit; a deviceless target's: what the `deviceless_memory` in
  effect says (its datasheet memory, a GPU's at JAX's allocator fraction)."""
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001  (a deviceless topology's device has no allocator to ask)
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{device.device_kind}'s allocator limit"
  for limit_of in reversed(_deviceless.stack):
    limit, source = limit_of(device)
    if limit is not None:
      return limit, source
  return None, f"no memory limit known for a {device.platform} device"


def compiled_memory(compiled) -> dict:
  """The compiler's buffer sizes per device (bytes); peak = arguments + outputs − aliased + temporaries."""
  m = compiled.memory_analysis()
  sizes = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes}
  return dict(sizes, peak=sizes["arguments"] + sizes["outputs"] - sizes["aliased"] + sizes["temporaries"])


def _next_try(sizes: list[int], i: int, tried: dict, fixed: int, limit: int) -> int:
  """The index of the next size to try after `sizes[i]` did not fit: the largest smaller one that a line
  says fits — through the two smallest blocked tries, else through the last try and (0 rows, `fixed`),
  the bytes that do not grow with the block (the state, in and out) — and at least the next one."""
  blocked = sorted(s for s in tried if s != sizes[0])
  if len(blocked) >= 2:
    (x0, x1) = blocked[:2]
    y0, y1 = tried[x0], tried[x1]
  else:
    x0, y0, x1, y1 = 0, fixed, sizes[i], tried[sizes[i]]
  slope = (y1 - y0) / (x1 - x0)
  if slope <= 0:
    return i + 1
  most = x0 + (limit - y0) / slope
  return next((j for j in range(i + 1, len(sizes)) if sizes[j] <= most), len(sizes) - 1)


def choose(sizes: list[int], peak_of: Callable[[int], tuple[int, int]], limit: int) -> tuple[int, int, dict]:
  """(size, its peak, {size: peak} of every try): the largest of `sizes` (largest first, the whole batch
  first) whose peak is at most `limit`. `peak_of(size)` compiles: (the step's peak, the bytes of it that do
  not grow with the block). A failed try skips to the size a line through the tries says fits
  (`_next_try`); a fit below a size not tried is tried upwards, one size at a time, until the next larger
  one does not fit. `LookupError` (holding the tries) when even the smallest does not fit."""
  tried, i = {}, 0
  while True:
    tried[sizes[i]], fixed = peak_of(sizes[i])
    if tried[sizes[i]] <= limit:
      break
    if i == len(sizes) - 1:
      raise LookupError(tried)
    i = _next_try(sizes, i, tried, fixed, limit)
  while i > 0 and sizes[i - 1] not in tried:  # a size skipped above the fit: the largest must be shown
    tried[sizes[i - 1]], _ = peak_of(sizes[i - 1])
    if tried[sizes[i - 1]] > limit:
      break
    i -= 1
  return sizes[i], tried[sizes[i]], tried


def _gib(n: float) -> str:
  return f"{n / 2 ** 30:.2f} GiB"


def resolve(config: ml_collections.ConfigDict, rows: int, row_devices: int, device,
            peak_of: Callable[[int], tuple[int, int]]) -> str:
  """`chunk_size` for `config` (as text): a number as it is; "auto" the largest block of the `rows` of the
  padded global batch split over `row_devices` whose step's peak (`peak_of(size)`: a compile, `choose`) fits
  `device`'s memory (`memory_limit`), "0" for the whole batch; said in one log line. `ConfigError` when
  even the smallest block does not fit."""
  if not is_auto(config):
    return str(config.get("chunk_size", WHOLE)).strip()
  limit, source = memory_limit(device)
  if limit is None:
    logging.info("chunk_size=auto: %s: the whole batch of %d rows in one block", source, rows)
    return WHOLE
  sizes = block_sizes(rows, row_devices)
  try:
    size, peak, tried = choose(sizes, peak_of, limit)
  except LookupError as e:
    smallest = min(e.args[0])
    raise ConfigError(f"chunk_size=auto: no block of the {rows}-row batch fits the memory ({_gib(limit)}, {source}): "
                      f"even blocks of {smallest} row(s) peak at {_gib(e.args[0][smallest])} per device; lower "
                      "batch_size or model.max_length, or set model.remat=full") from None
  what = f"the whole batch ({rows} rows) in one block" if size == rows else f"{size} rows per block"
  logging.info("chunk_size=auto: %s, peak %s of %s (%s; tried %s)", what, _gib(peak), _gib(limit), source,
               ", ".join(f"{s} rows {_gib(p)}" for s, p in tried.items()))
  return WHOLE if size == rows else str(size)
