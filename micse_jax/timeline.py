"""Where a run's seconds go: wall time per phase, with every JAX compilation counted apart.

A `Timeline` attributes the wall clock of a session to the innermost open `phase(...)` (time in
no phase is `other`), and listens to JAX's own compile events (`jax.monitoring` time spans of
`COMPILE_EVENTS`: tracing to a jaxpr, lowering to MLIR, the backend compile or the persistent
cache read). Their union is `compile_s`; each phase's seconds exclude the compiles inside it, so
`train_s` is the steps alone and the phases plus `compile_s` add up to `total_s`.

Code that runs inside a run without holding the timeline (`training/setup.py`) marks its phases
with the module-level `phase(name)`, a no-op when no timeline is active.

A workdir's `timeline.json` holds one entry per session (a resume adds one) under `sessions`,
and at the top level the sums over sessions: the run's cost, however often it was resumed.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time

from micse_jax import jsonio

PHASES = ("data", "load", "train", "eval", "final_eval", "save", "other")
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
KEYS = ("compile_s",) + tuple(f"{p}_s" for p in PHASES) + ("total_s",)

_active: Timeline | None = None


def _union_length(spans: list[tuple[float, float]]) -> float:
  """Seconds covered by the union of (start, end) spans."""
  covered, reach = 0.0, -float("inf")
  for start, end in sorted(spans):
    if end > reach:
      covered += end - max(start, reach)
      reach = end
  return covered


def _overlap(span: tuple[float, float], merged: list[tuple[float, float]]) -> float:
  """Seconds of `span` covered by the disjoint sorted spans `merged`."""
  return sum(max(0.0, min(span[1], e) - max(span[0], s)) for s, e in merged)


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """The union of spans as disjoint sorted spans."""
  out: list[list[float]] = []
  for start, end in sorted(spans):
    if out and start <= out[-1][1]:
      out[-1][1] = max(out[-1][1], end)
    else:
      out.append([start, end])
  return [(s, e) for s, e in out]


class Timeline:
  """One session's phases and compile spans; `start()` begins listening, `finish()` stops."""

  def __init__(self):
    self._lock = threading.Lock()
    self._stack: list[str] = ["other"]
    self._segments: list[tuple[str, float, float]] = []
    self._compiles: list[tuple[float, float]] = []
    self._mark = self._t0 = time.time()
    self._end: float | None = None
    self.compile_count = 0
    self.info: dict = {}  # further fields of the session's entry (steps, cache folder, ...)
    self._listening = False

  def _on_span(self, event: str, start: float, end: float, **_) -> None:
    if event in COMPILE_EVENTS:
      with self._lock:
        self._compiles.append((start, end))
        self.compile_count += event == COMPILE_EVENTS[-1]

  def start(self) -> "Timeline":
    """Starts the clock and the compile listener; makes this the active timeline."""
    global _active
    import jax
    jax.monitoring.register_event_time_span_listener(self._on_span)
    self._listening = True
    self._mark = self._t0 = time.time()
    _active = self
    return self

  def _switch(self, push: str | None) -> None:
    """Closes the current segment; pushes `push` (or pops when None)."""
    now = time.time()
    self._segments.append((self._stack[-1], self._mark, now))
    self._mark = now
    if push is None:
      self._stack.pop()
    else:
      self._stack.append(push)

  @contextlib.contextmanager
  def phase(self, name: str):
    """Attributes the wall time inside to `name` (nested phases take their own share)."""
    if name not in PHASES:
      raise ValueError(f"unknown timeline phase {name!r}; expected one of {PHASES}")
    self._switch(name)
    try:
      yield
    finally:
      self._switch(None)

  def finish(self) -> dict:
    """Stops listening; returns {'compile_s', '<phase>_s', 'total_s', 'compiles', **info} of the session."""
    global _active
    import jax
    if self._end is None:
      self._segments.append((self._stack[-1], self._mark, time.time()))
      self._end = time.time()
      if self._listening:
        jax.monitoring.unregister_event_time_span_listener(self._on_span)
        self._listening = False
      if _active is self:
        _active = None
    with self._lock:
      compiles = _merged([(max(s, self._t0), min(e, self._end)) for s, e in self._compiles if e > self._t0])
    seconds = dict.fromkeys(PHASES, 0.0)
    for name, start, end in self._segments:
      seconds[name] += (end - start) - _overlap((start, end), compiles)
    out = {"compile_s": _union_length(compiles), **{f"{p}_s": max(0.0, v) for p, v in seconds.items()},
           "total_s": self._end - self._t0, "compiles": self.compile_count}
    return {**{k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}, **self.info}


@contextlib.contextmanager
def phase(name: str):
  """`Timeline.phase` of the active timeline; nothing when none is active."""
  active = _active
  if active is None:
    yield
    return
  with active.phase(name):
    yield


def now_iso() -> str:
  """The current UTC time, ISO 8601 to the second."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def add_session(path: str, session: dict) -> dict:
  """Appends `session` to the timeline file at `path` (atomically); the top level holds the
  sums over all sessions. Returns the document written."""
  sessions = []
  if os.path.isfile(path):
    try:
      sessions = list(jsonio.read_json(path).get("sessions", []))
    except (OSError, ValueError, AttributeError):
      sessions = []  # an unreadable file from an older version: start over
  sessions.append(session)
  totals = {k: round(sum(float(s.get(k) or 0.0) for s in sessions), 3) for k in KEYS}
  document = {**totals, "compiles": sum(int(s.get("compiles") or 0) for s in sessions),
              "num_sessions": len(sessions), "sessions": sessions}
  jsonio.write_json(path, document)
  return document


def one_line(document: dict) -> str:
  """`compile 12.3 s, data 1.0 s, ..., total 75.0 s` of a timeline document."""
  parts = [f"{k[:-2].replace('_', ' ')} {float(document.get(k) or 0.0):.1f} s" for k in KEYS]
  sessions = document.get("num_sessions", 1)
  return ", ".join(parts) + (f" ({sessions} sessions)" if sessions and sessions > 1 else "")
