"""The prefetch thread: order, bounded look-ahead, exceptions with their traceback, clean shutdown."""
import itertools
import threading
import time
import traceback

import pytest

from micse_jax.data.prefetch import Prefetcher


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_yields_every_result_in_order(depth):
  with Prefetcher(lambda i: (i, i * i), range(23), depth) as batches:
    assert list(batches) == [(i, i * i) for i in range(23)]
  assert not batches.alive


def _produced_after_each_next(depth: int, steps: int = 5, expected=None) -> list[int]:
  """How many items `produce` has been called on after 0, 1, ..., `steps` `next()` calls, each
  read once the producer has caught up with `expected(consumed)` (2 s at most) and 50 ms more."""
  produced = []
  def produce(i):
    produced.append(i)
    return i
  counts = []
  with Prefetcher(produce, itertools.count(), depth) as batches:
    for consumed in range(steps + 1):
      if consumed:
        assert next(batches) == consumed - 1
      deadline = time.monotonic() + 2.0
      while expected and len(produced) < expected(consumed) and time.monotonic() < deadline:
        time.sleep(0.005)
      time.sleep(0.05)  # room to run further ahead than it may
      counts.append(len(produced))
  assert not batches.alive
  return counts


@pytest.mark.parametrize("depth", [1, 3])
def test_reads_exactly_depth_ahead(depth):
  """`depth` results wait in the queue and one more is produced and blocked on put(): after c
  next() calls, c + depth + 1 items were produced, not fewer (no read-ahead) and not more."""
  ahead = lambda consumed: consumed + depth + 1
  assert _produced_after_each_next(depth, expected=ahead) == [ahead(c) for c in range(6)]


def test_depth_zero_produces_only_on_demand():
  """Inline production: exactly one item per next() (what a prefetcher that never reads ahead
  does, which the test above rejects)."""
  assert _produced_after_each_next(0) == list(range(6))


def _explode_at_three(i):
  if i == 3:
    raise ValueError(f"bad item {i}")
  return i


@pytest.mark.parametrize("depth", [0, 2])
def test_producer_exception_reaches_consumer_with_its_traceback(depth):
  got = []
  with pytest.raises(ValueError, match="bad item 3") as e:
    with Prefetcher(_explode_at_three, range(10), depth) as batches:
      for value in batches:
        got.append(value)
  assert got == [0, 1, 2]
  frames = [f.name for f in traceback.extract_tb(e.value.__traceback__)]
  assert "_explode_at_three" in frames  # the producer thread's frame is in the traceback
  assert not batches.alive


def test_consumer_error_and_early_exit_stop_the_thread():
  before = threading.active_count()
  with pytest.raises(KeyboardInterrupt):
    with Prefetcher(lambda i: i, itertools.count(), 2) as batches:
      next(batches)
      raise KeyboardInterrupt("simulated preemption")
  assert not batches.alive
  for _ in range(3):  # an infinite source, closed without being exhausted
    p = Prefetcher(lambda i: i, itertools.count(), 4)
    assert next(p) == 0
    p.close()
    assert not p.alive
  assert threading.active_count() == before
  with pytest.raises(ValueError, match="depth"):
    Prefetcher(lambda i: i, range(3), -1)
