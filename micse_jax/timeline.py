"""Where a run's seconds go: wall time per phase, with every JAX compilation counted apart.

A `Timeline` attributes the wall clock of a session to the innermost open `phase(...)` (time in
no phase is `other`), and listens to JAX's own compile events (`jax.monitoring` time spans of
`COMPILE_EVENTS`: tracing to a jaxpr, lowering to MLIR, the backend compile or the persistent
cache read). Their union is `compile_s`; each phase's seconds exclude the compiles inside it, so
`train_s` is the steps alone and the phases plus `compile_s` add up to `total_s`.

Code that runs inside a run without holding the timeline (`training/run_inputs.py`) marks its phases
with the module-level `phase(name)`, a no-op when no timeline is active.

A workdir's `timeline.json` holds one entry per session (a resume adds one) under `sessions`,
and at the top level the sums over sessions: the run's cost, however often it was resumed.
A session's entry is written at each checkpoint once it has committed (`checkpoint_saved`, called
by the trainer's checkpoint writer) and once more when the session ends, replacing its earlier
version (matched by its `id`), so a process killed at any moment leaves its time up to its last
committed checkpoint on record, and never a step it did not save. Each save's time holding the
loop (its copy to the host) is listed under `saves` (`save_blocked`).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
import uuid
from typing import Callable

from micse_jax import jsonio

# JAX is imported where a timeline starts listening or is written: reading and summing timeline
# files (a sweep's report) needs no JAX.
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

  def __init__(self, files: Callable[[], list[str]] | None = None):
    """`files()`: the `timeline.json` paths `record()` writes the session to (asked at each write:
    a population's member folders appear during the run)."""
    self._files = files
    self.id = uuid.uuid4().hex[:16]  # the session's entry is replaced, not added, when written again
    self._lock = threading.Lock()
    self.writing = threading.RLock()  # the loop's and the checkpoint writer's threads both write the entry
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
    return self._summary(self._end, self._segments)

  def snapshot(self) -> dict:
    """`finish()`'s summary of the session so far, without stopping it."""
    if self._end is not None:
      return self.finish()
    now = time.time()
    return self._summary(now, [*self._segments, (self._stack[-1], self._mark, now)])

  def _summary(self, end: float, segments: list[tuple[str, float, float]]) -> dict:
    with self._lock:
      compiles = _merged([(max(s, self._t0), min(e, end)) for s, e in self._compiles if e > self._t0])
    seconds = dict.fromkeys(PHASES, 0.0)
    for name, start, stop in segments:
      seconds[name] += (stop - start) - _overlap((start, stop), compiles)
    out = {"compile_s": _union_length(compiles), **{f"{p}_s": max(0.0, v) for p, v in seconds.items()},
           "total_s": end - self._t0, "compiles": self.compile_count}
    return {**{k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}, **self.info}

  def record(self) -> None:
    """Writes the session so far (its `id`, `ended_at` now) to each of `files()`, replacing its
    earlier entry; first process only, and only once the run recorded its `steps` (its input
    was accepted). A file that cannot be written is a warning."""
    import jax
    if self._files is None or "steps" not in self.info or jax.process_index() != 0:
      return
    with self.writing:
      entry = {"id": self.id, "ended_at": now_iso(), **self.snapshot()}
      for path in self._files():
        try:
          add_session(path, entry)
        except OSError as e:
          logging.warning("could not write %s: %s", path, e)


def checkpoint_saved(committed: int | None) -> None:
  """At a checkpoint: the active session's timeline entry is written, its `steps.to` the newest step
  whose save has committed (`committed`; None: none yet, `steps.to` unchanged). A save still being
  written is not claimed: a kill before it commits resumes from the step before it."""
  active = _active
  if active is None:
    return
  with active.writing:
    steps = active.info.get("steps")
    if isinstance(steps, dict) and committed is not None:
      steps["to"] = max(int(committed), int(steps.get("from", committed)))
    active.record()


def save_blocked(step: int, seconds: float, kind: str = "rolling") -> None:
  """The active session's save of `kind` ("rolling": the train state; "best": a run's best params)
  at `step` held the loop for `seconds` (its copy to the host): listed under the entry's `saves`, and
  the entry written (as at a committed checkpoint: a kill before this save commits finds the session
  on record, up to the checkpoint before)."""
  active = _active
  if active is not None:
    with active.writing:
      active.info.setdefault("saves", []).append({"step": int(step), "kind": kind, "blocking_s": round(seconds, 4)})
      active.record()


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
  """Appends `session` to the timeline file at `path` (atomically), or replaces the entry of
  the same `id`; the top level holds the sums over all sessions. Returns the document written."""
  sessions = []
  if os.path.isfile(path):
    try:
      sessions = list(jsonio.read_json(path).get("sessions", []))
    except (OSError, ValueError, AttributeError):
      sessions = []  # an unreadable file from an older version: start over
  same = [i for i, s in enumerate(sessions) if session.get("id") is not None and s.get("id") == session["id"]]
  if same:
    sessions[same[0]] = session
  else:
    sessions.append(session)
  totals = {k: round(sum(float(s.get(k) or 0.0) for s in sessions), 3) for k in KEYS}
  document = {**totals, "compiles": sum(int(s.get("compiles") or 0) for s in sessions),
              "num_sessions": len(sessions), "sessions": sessions}
  jsonio.write_json(path, document)
  return document


def loop_line(document: dict) -> str | None:
  """`5 training steps per call (1 for the gaps 5 does not divide); saves held the loop 0.4 s (6 saves)`
  of a timeline document's last session, or None when it trained nothing."""
  sessions = document.get("sessions") or [document]
  last = sessions[-1]
  lengths = last.get("steps_per_dispatch")
  if not lengths:
    return None
  line = f"{lengths[0]} training step(s) per call"
  if len(lengths) > 1:
    line += f" ({', '.join(map(str, lengths[1:]))} for the gaps between syncs {lengths[0]} does not divide)"
  saves = last.get("saves") or []
  if saves:
    line += f"; saves held the loop {sum(s['blocking_s'] for s in saves):.2f} s ({len(saves)} saves)"
  return line


def one_line(document: dict) -> str:
  """`compile 12.3 s, data 1.0 s, ..., total 75.0 s` of a timeline document."""
  parts = [f"{k[:-2].replace('_', ' ')} {float(document.get(k) or 0.0):.1f} s" for k in KEYS]
  sessions = document.get("num_sessions", 1)
  return ", ".join(parts) + (f" ({sessions} sessions)" if sessions and sessions > 1 else "")
