"""Several steps per call (`steps_per_dispatch`, `training/dispatch.py`): the chunk plan against hand-made
cases; K = 4 trains exactly the run of K = 1 (state, logged scalars, best checkpoint) for a solo run and
a population, with logs, evaluations and saves on steps K does not divide; a resume that changes K."""
import glob
import os
import struct

import jax
import numpy as np
import pytest

from micse_jax import jsonio
from micse_jax import workdir as workdir_lib
from micse_jax.training import checkpoint, dispatch, trainer
from tests.train_utils import restore_latest, tiny_training_config, train_preempted_after_first_save


@pytest.mark.parametrize("start, syncs, steps, want", [
    (0, [8], 4, [(0, 4), (4, 4)]),
    (0, [5, 6, 10], 4, [(0, 4), (4, 1), (5, 1), (6, 4)]),                   # r = gcd(4, 5, 1, 4) = 1
    (0, [6, 12, 14], 4, [(0, 4), (4, 2), (6, 4), (10, 2), (12, 2)]),        # r = 2
    (6, [12, 14], 4, [(6, 4), (10, 2), (12, 2)]),                            # a resume from a saved step
    (0, [3, 6], 1, [(i, 1) for i in range(6)]),
])
def test_the_plan_ends_a_chunk_on_every_sync_step_with_two_lengths_at_most(start, syncs, steps, want):
  chunks = dispatch.plan(start, syncs, steps)
  assert chunks == want
  ends = {first + n for first, n in chunks}
  assert set(syncs) <= ends and len({n for _, n in chunks}) <= 2


def test_sync_steps_are_the_due_steps_and_the_last():
  due = lambda done: done % 4 == 0
  assert dispatch.sync_steps(0, 10, due) == [4, 8, 10]
  assert dispatch.sync_steps(8, 10, due) == [10]
  assert dispatch.usual_gap(dispatch.gaps(0, [10, 20, 25, 30, 33])) == 5  # the last gap (3) left out


def test_auto_takes_one_step_off_cuda_and_where_the_gpu_is_busy_enough():
  flops_b50 = 1.92e12  # BERT-base at batch 50 (training/flops.py)
  assert dispatch.auto_steps("cpu", None, flops_b50, 1000, 12, 10) == 1
  assert dispatch.auto_steps("cuda", (9, 0), 10 * flops_b50, 1000, 12, 10) == 1  # batch 512: device-bound
  k = dispatch.auto_steps("cuda", (9, 0), flops_b50, 1000, 12, 10)
  assert k in (2, 5, 10)
  device = dispatch.device_seconds(flops_b50, (9, 0))
  per_step = lambda n: dispatch.estimated_call_seconds(n, 1000, 12) / n
  assert per_step(k) <= device and per_step(1) > device  # the smallest divisor of 10 that keeps up


def _scalars(folder: str) -> dict:
  """{(tag, step): value} of a run's TensorBoard event files (TFRecord frames read by hand)."""
  from tensorboardX.proto import event_pb2
  found = {}
  for path in glob.glob(os.path.join(folder, workdir_lib.TENSORBOARD_DIR, "events.*")):
    data, offset = open(path, "rb").read(), 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        if value.tag != "train/steps_per_sec":
          found[(value.tag, event.step)] = value.simple_value
  return found


def _assert_same_run(config, a: str, b: str, folders=("",)) -> None:
  state_a, state_b = restore_latest(config, a), restore_latest(config, b)
  assert int(state_a.step) == int(state_b.step) == config.num_train_steps
  for x, y in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for folder in folders:
    scalars_a, scalars_b = _scalars(os.path.join(a, folder)), _scalars(os.path.join(b, folder))
    assert scalars_a and scalars_a == scalars_b
    best_a, best_b = (workdir_lib.best_manager(os.path.join(w, folder), read_only=True).all_steps() for w in (a, b))
    assert best_a == best_b


def _config(tmp_path, minilm_dir, senteval_dir, **fields):
  """Ten steps: logs after 5 and 10, saves after 6 and 10, evaluations after 5 and 10 (K = 4 cuts
  its chunks at 4, 5, 6 and 10)."""
  config = tiny_training_config(tmp_path, minilm_dir, num_train_steps=10, log_every=5, checkpoint_every=6,
                                eval_every=5, **{"eval.senteval_dir": senteval_dir, "data.num_sentences": 24})
  config.analysis.enabled = False
  for key, value in fields.items():
    config.population[key] = value
  return config


def test_four_steps_per_call_train_the_run_of_one(tmp_path, minilm_dir, senteval_dir):
  config = _config(tmp_path, minilm_dir, senteval_dir)
  runs = {}
  for k in ("1", "4"):
    config.steps_per_dispatch = k
    runs[k] = str(tmp_path / f"k{k}")
    trainer.train_and_evaluate(config, runs[k])
  _assert_same_run(config, runs["1"], runs["4"])
  timeline = jsonio.read_json(os.path.join(runs["4"], workdir_lib.TIMELINE_FILE))
  assert timeline["sessions"][0]["steps_per_dispatch"] == [4, 1]
  assert [s["step"] for s in timeline["sessions"][0]["saves"] if s["kind"] == "rolling"] == [6, 10]


@pytest.mark.slow
def test_a_population_trains_alike_with_four_steps_per_call(tmp_path, minilm_dir, senteval_dir):
  config = _config(tmp_path, minilm_dir, senteval_dir, seeds=(3, 4), learning_rates=(1e-3, 2e-3))
  runs = {}
  for k in ("1", "4"):
    config.steps_per_dispatch = k
    runs[k] = str(tmp_path / f"k{k}")
    trainer.train_and_evaluate(config, runs[k])
  _assert_same_run(config, runs["1"], runs["4"], folders=[os.path.join("members", "0"), os.path.join("members", "1")])


@pytest.mark.slow  # ~35 s: K steps per call equal K calls stays in the default run, as does the resume
def test_a_resume_with_another_k_continues_the_same_run(tmp_path, minilm_dir, senteval_dir, monkeypatch):
  config = _config(tmp_path, minilm_dir, senteval_dir)
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  config.steps_per_dispatch = "1"
  trainer.train_and_evaluate(config, straight)
  config.steps_per_dispatch = "3"
  train_preempted_after_first_save(trainer, checkpoint, monkeypatch, config, resumed)
  assert workdir_lib.rolling_manager(resumed, 2).latest_step() == 6
  config.steps_per_dispatch = "4"
  trainer.train_and_evaluate(config, resumed)  # from step 6 with another K
  state_a, state_b = restore_latest(config, straight), restore_latest(config, resumed)
  for x, y in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
