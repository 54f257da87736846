"""Step times two ways, the same for micse_jax and the PyTorch peers.

* **pipelined** (the headline): runs of `steps` steps dispatched back to back with one wait at
  the end of each run, as the trainer runs them (it waits only when it logs, evaluates or
  saves), so the host's dispatch of step i+1 overlaps the device's work on step i; the time of a
  run over `steps`, median over `rounds` runs.
* **blocked**: each step waited for before the next is dispatched; the median of single steps.
  The gap between the two is the host's launch latency and the device's idle time per step.

A peer gives two callables: `dispatch()` launches one step and returns a handle to its result
without waiting for it (a JAX step's metrics, a PyTorch step's loss tensor, never `.item()`),
and `wait(handle)` blocks until the device has finished it (`jax.block_until_ready`;
`torch.cuda.synchronize`). Steps depend on their predecessor's state, so waiting for the last
step of a run waits for the whole run.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

PIPELINED = ("pipelined: runs of {steps} calls dispatched back to back, one wait per run (as the trainer runs), "
             "median of {rounds} runs; blocked: median of {steps} single calls, each waited for; per training step")


def blocked_seconds(dispatch: Callable[[], Any], wait: Callable[[Any], Any], steps: int) -> list[float]:
  """Wall seconds of `steps` single steps, each dispatched and waited for."""
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    wait(dispatch())
    times.append(time.perf_counter() - t)
  return times


def pipelined_seconds(dispatch: Callable[[], Any], wait: Callable[[Any], Any], steps: int,
                      rounds: int, dispatched: list | None = None) -> list[float]:
  """Seconds per step of each of `rounds` runs of `steps` steps with one wait per run; the host's
  seconds per step spent dispatching (before the wait) are appended to `dispatched`."""
  per_step = []
  for _ in range(rounds):
    t = time.perf_counter()
    handle = None
    for _ in range(steps):
      handle = dispatch()
    if dispatched is not None:
      dispatched.append((time.perf_counter() - t) / steps)
    wait(handle)
    per_step.append((time.perf_counter() - t) / steps)
  return per_step


def measure(dispatch: Callable[[], Any], wait: Callable[[Any], Any], warmup: int, steps: int,
            rounds: int, steps_per_call: int = 1) -> dict:
  """`warmup` untimed calls, then blocked and pipelined times per training step (ms; a call runs
  `steps_per_call` of them): `blocked_step_ms`, `pipelined_step_ms`, `pipelined_rounds_ms` (one per
  run, to show the spread), and `dispatch_step_ms`, the host's time per step to dispatch a pipelined
  run: near the pipelined time, the step is host-bound (the device waits for the host)."""
  for _ in range(warmup):
    wait(dispatch())
  blocked = blocked_seconds(dispatch, wait, steps)
  dispatched = []
  pipelined = pipelined_seconds(dispatch, wait, steps, rounds, dispatched)
  ms = lambda seconds: 1e3 * seconds / steps_per_call
  return {"pipelined_step_ms": ms(statistics.median(pipelined)), "blocked_step_ms": ms(statistics.median(blocked)),
          "pipelined_rounds_ms": [ms(s) for s in pipelined], "dispatch_step_ms": ms(statistics.median(dispatched)),
          "steps_per_call": steps_per_call}


def jax_peer(step) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
  """(dispatch, wait) of a compiled micse_jax program (`bench/jax_step.JaxStep`, after `compile()`):
  dispatch makes one call (its `steps` steps) on the step's state (donated, replaced) and returns its
  metrics; `measure(..., steps_per_call=step.steps)` gives the times per training step."""
  import jax  # here, not at the top: the PyTorch peers time with this module too, without JAX
  return step.call, jax.block_until_ready


def _steps_per_dispatch(text: str) -> str:
  """argparse's type of --steps_per_dispatch: "auto" or an integer >= 1, kept as text (the config's)."""
  if text == "auto" or (text.isdigit() and int(text) >= 1):
    return text
  raise argparse.ArgumentTypeError(f"{text!r}: auto or an integer >= 1")


def add_arguments(parser) -> None:
  """The timing flags of `python -m micse_jax.bench`: --steps, --rounds, --warmup."""
  parser.add_argument("--steps", type=int, default=10,
                      help="calls per timed run (one training step each, or --steps_per_dispatch): blocked, the median "
                           "of this many single calls; pipelined, runs of this many calls with one wait each")
  parser.add_argument("--steps_per_dispatch", default="auto", type=_steps_per_dispatch,
                      help="training steps per call of the micse_jax program: an integer >= 1, or auto (the "
                           "trainer's choice for this device: training/dispatch.py); times are per training step")
  parser.add_argument("--rounds", type=int, default=3, help="pipelined runs of --steps steps (median reported)")
  parser.add_argument("--warmup", type=int, default=2,
                      help="untimed steps first (the compiled PyTorch peer's second step still compiles: keep >= 2)")
