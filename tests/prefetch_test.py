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


def test_stays_at_most_depth_ahead():
  produced, depth = [], 3
  def produce(i):
    produced.append(i)
    return i
  with Prefetcher(produce, itertools.count(), depth) as batches:
    for consumed, value in enumerate(batches, start=1):
      assert value == consumed - 1
      time.sleep(0.05)  # let the producer run ahead as far as it may
      # `depth` waiting in the queue plus one produced and blocked on put()
      assert consumed <= len(produced) <= consumed + depth + 1
      if consumed == 6:
        break
  assert not batches.alive


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
