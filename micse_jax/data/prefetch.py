"""A background thread that keeps the next few (device-placed) batches ready.

`Prefetcher(produce, items, depth)` calls `produce(item)` for each item in order on one daemon
thread, keeping at most `depth` results waiting in a queue; iterating it yields the results in
order. An exception raised by `produce` is re-raised by the consumer's `next()` with the
producer thread's traceback attached (`raise error` keeps `error.__traceback__`). `close()` (also
on leaving the `with` block, normally or by an exception) stops the thread and joins it, so no
thread outlives training. `depth=0` produces inline, without a thread.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator

_POLL_S = 0.1  # how often a blocked put/get re-checks that the other side is still there


class _Failed:
  """The producer's exception, passed through the queue."""

  def __init__(self, error: BaseException):
    self.error = error


_END = object()


class Prefetcher:
  """Ordered, bounded, exception-propagating background production of `produce(item)`."""

  def __init__(self, produce: Callable[[Any], Any], items: Iterable, depth: int = 2):
    if depth < 0:
      raise ValueError(f"prefetch depth must be >= 0, got {depth}")
    self._produce, self._items, self.depth = produce, iter(items), int(depth)
    self._stop = threading.Event()
    self._thread = None
    if self.depth:
      self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
      self._thread = threading.Thread(target=self._work, name="micse-prefetch", daemon=True)
      self._thread.start()

  def _put(self, value) -> bool:
    """Puts `value`, waiting for room; False when the consumer closed meanwhile."""
    while not self._stop.is_set():
      try:
        self._queue.put(value, timeout=_POLL_S)
        return True
      except queue.Full:
        continue
    return False

  def _work(self) -> None:
    try:
      for item in self._items:
        if self._stop.is_set() or not self._put(self._produce(item)):
          return
      self._put(_END)
    except BaseException as error:  # re-raised in the consumer
      self._put(_Failed(error))

  def __iter__(self) -> Iterator:
    return self

  def __next__(self):
    if self._thread is None:  # depth 0: inline
      if self._stop.is_set():
        raise StopIteration
      return self._produce(next(self._items))
    while True:
      try:
        value = self._queue.get(timeout=_POLL_S)
        break
      except queue.Empty:
        if self._stop.is_set() or not self._thread.is_alive() and self._queue.empty():
          raise StopIteration from None
    if value is _END:
      self._stop.set()
      raise StopIteration
    if isinstance(value, _Failed):
      self._stop.set()
      raise value.error
    return value

  def close(self, timeout: float = 60.0) -> None:
    """Stops the producer and waits for its thread to end (it finishes the item in hand first)."""
    self._stop.set()
    if self._thread is None:
      return
    while self._thread.is_alive():
      try:  # make room so a producer blocked in put() sees the stop flag
        while True:
          self._queue.get_nowait()
      except queue.Empty:
        pass
      self._thread.join(timeout=_POLL_S)
      timeout -= _POLL_S
      if timeout <= 0:
        raise RuntimeError("the prefetch thread did not stop within its timeout")

  @property
  def alive(self) -> bool:
    """Whether the producer thread is still running."""
    return self._thread is not None and self._thread.is_alive()

  def __enter__(self) -> "Prefetcher":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
