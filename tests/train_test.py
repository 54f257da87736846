"""Trainer: queue/EMA/schedule formulas, one step per objective, 4 devices == 1 device,
bit-identical resume, non-finite stop, bad input → one error line and nothing written."""
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax import workdir as workdir_lib
from micse_jax.errors import CheckpointError
from micse_jax.losses.ami import resolve_layers
from micse_jax.training import checkpoint, run_inputs, trainer
from micse_jax.training.momentum import Queue, ema_update
from micse_jax.training.optim import learning_rate_schedule
from tests.helpers import run_device_worker
from tests.train_utils import (
  in_flat_layout,
  program_steps,
  restore_latest,
  rewrite_in_old_layout,
  tiny_training_config,
  train_preempted_after_first_save,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_enqueue_is_a_ring_buffer():
  queue = Queue.empty(5, 2)
  ref, ref_ids = np.zeros((5, 2), np.float32), np.full(5, -1)
  ref_ptr, written = 0, set()
  for n, batch in enumerate([np.full((3, 2), 1.0), np.full((3, 2), 2.0), np.full((4, 2), 3.0)]):
    batch_ids = 10 * n + np.arange(len(batch))
    queue = queue.push(jnp.asarray(batch, jnp.float32), jnp.asarray(batch_ids))  # ids at the keys' slots
    for row, row_id in zip(batch, batch_ids):  # NumPy reference: write one by one at the pointer, wrap around
      ref[ref_ptr], ref_ids[ref_ptr] = row, row_id
      written.add(ref_ptr)
      ref_ptr = (ref_ptr + 1) % 5
    np.testing.assert_array_equal(np.asarray(queue.embeddings), ref)
    np.testing.assert_array_equal(np.asarray(queue.ids), ref_ids)
    assert queue.ids.dtype == jnp.int32
    assert int(queue.ptr) == ref_ptr
    assert set(np.flatnonzero(np.asarray(queue.valid))) == written
    assert set(np.flatnonzero(np.asarray(queue.ids) >= 0)) == written  # -1 exactly on empty slots
  np.testing.assert_array_equal(ref_ids, [12, 20, 21, 22, 23])  # by hand: 3 + 3 + 4 writes into 5 slots


def test_ema_update_formula():
  online = {"w": jnp.array([1.0, 2.0]), "b": {"c": jnp.array(3.0)}}
  target = {"w": jnp.array([0.0, 4.0]), "b": {"c": jnp.array(-1.0)}}
  new = ema_update(online, target, 0.995)
  np.testing.assert_allclose(new["w"], 0.995 * np.array([0.0, 4.0]) + 0.005 * np.array([1.0, 2.0]), rtol=1e-6)
  np.testing.assert_allclose(new["b"]["c"], 0.995 * -1.0 + 0.005 * 3.0, rtol=1e-6)


def test_linear_warmup_then_linear_decay():
  import ml_collections
  c = ml_collections.ConfigDict({"num_train_steps": 1000, "optim": {"warmup_steps": 250, "learning_rate": 3e-5}})
  lr = learning_rate_schedule(c)
  for step in (0, 100, 250, 400, 999, 1000):  # HF get_linear_schedule_with_warmup, by hand
    expected = 3e-5 * (step / 250 if step < 250 else (1000 - step) / 750)
    assert float(lr(step)) == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_ami_layer_indices():
  assert resolve_layers((-4, -3, -2, -1), 12) == (8, 9, 10, 11)
  assert resolve_layers((7, 8, 9, 10), 12) == (7, 8, 9, 10)
  with pytest.raises(ValueError):
    resolve_layers((12,), 12)


def _run_steps(config, n):
  init, state, history = program_steps(config, n)
  return init, state, history[-1]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, minilm_dir):
  """(config, step-0 state, state and metrics after 2 steps) of the tiny run of an objective, each run once
  for the tests of this module that read it."""
  root, runs = tmp_path_factory.mktemp("two_steps"), {}

  def run(variant):
    if variant not in runs:
      config = tiny_training_config(root, minilm_dir, variant)
      runs[variant] = (config, *_run_steps(config, 2))
    return runs[variant]
  return run


@pytest.mark.parametrize("variant", ["simcse", "ami_simcse", "moco_simcse", "micse"])
def test_one_step_of_each_objective(two_steps, variant):
  config, init, state, metrics = two_steps(variant)  # step 0 has lr 0 (linear warm-up from 0, as HF)
  assert np.isfinite(metrics["loss"]) and int(state.step) == 2
  assert ("ami_mi" in metrics) == config.ami.enabled
  changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), init.params, state.params)
  pooler = changed["encoder"].pop("pooler")  # BERT's NSP pooler is not used by the objective
  assert all(jax.tree.leaves(changed)), "every used parameter (encoder and MLP head) is updated"
  assert not any(jax.tree.leaves(pooler))
  if config.momentum.enabled:  # the queue holds two batches of unit-norm momentum embeddings
    assert int(state.queue.ptr) == 16 % 12 and int(state.queue.valid.sum()) == 12
    np.testing.assert_allclose(np.linalg.norm(state.queue.embeddings, axis=1), 1.0, rtol=1e-5)
  else:
    assert state.queue is None and state.ema_params == {}


def test_ami_term_lowers_the_loss_by_lambda_times_mi(tmp_path, minilm_dir):
  """miCSE Eq. 5, L = L_C − λ·MI, checked across two runs rather than against the step's own
  sum: the first step (same init, data and dropout keys) with λ = 0 and with λ = 0.3 sees the
  same forward pass (the same MI), and its loss drops by exactly 0.3 · MI."""
  losses, mis = {}, {}
  for weight in (0.0, 0.3):
    config = tiny_training_config(tmp_path, minilm_dir, "ami_simcse")
    config.ami.weight = weight
    _, _, metrics = _run_steps(config, 1)
    losses[weight], mis[weight] = float(metrics["loss"]), float(metrics["ami_mi"])
  assert mis[0.0] == pytest.approx(mis[0.3], rel=1e-6) and mis[0.3] > 0
  assert losses[0.0] - losses[0.3] == pytest.approx(0.3 * mis[0.3], rel=1e-4)


def test_bfloat16_compute_trains_with_float32_params(tmp_path, minilm_dir):
  config = tiny_training_config(tmp_path, minilm_dir, "micse")
  config.model.dtype = "bfloat16"
  init, state, metrics = _run_steps(config, 2)
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["ami_mi"])
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), init.params["head"], state.params["head"])))


def test_momentum_encoder_is_ema_of_updated_online_encoder(two_steps):
  # The two warm-up steps of the tiny run: step 0 (lr 0) leaves the online encoder, so its EMA, where it
  # started (to float32 rounding of 0.995·θ + 0.005·θ), and step 1 is the first update.
  config, init, state, _ = two_steps("moco_simcse")
  assert config.optim.warmup_steps == 2 and int(state.step) == 2
  expected = jax.tree.map(lambda t, o: 0.995 * np.asarray(t) + 0.005 * np.asarray(o),
                          init.ema_params, state.params["encoder"])
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), init.ema_params, state.ema_params))
  assert any(moved)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(state.ema_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert int(state.queue.ptr) == 16 % 12 and int(state.queue.valid.sum()) == 12  # two pushes of 8 into 12 slots


def test_four_cpu_devices_match_one_device(tmp_path, minilm_dir):
  result = run_device_worker("tests.multidevice_worker", tmp_path, minilm_dir, timeout=600)
  assert result["num_devices"] == 4
  np.testing.assert_allclose(result["loss_4dev"], result["loss_1dev"], rtol=1e-5)
  assert result["max_state_diff"] < 1e-5


def _leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb) and la
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_continues_bit_identically(tmp_path, minilm_dir, monkeypatch):
  # Few-shot (n = 16 < Q + B = 20): the queue's sentence ids matter and must survive the resume.
  # The tiny run's 4 steps, saved every 2 (its program is the one other tests compile: a cache hit).
  config = tiny_training_config(tmp_path, minilm_dir, **{"data.num_sentences": 16})
  assert (config.num_train_steps, config.checkpoint_every) == (4, 2)
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  trainer.train_and_evaluate(config, straight)

  train_preempted_after_first_save(trainer, checkpoint, monkeypatch, config, resumed)
  assert workdir_lib.rolling_manager(resumed, 2).latest_step() == 2
  trainer.train_and_evaluate(config, resumed)  # restarts from step 2, data position included

  a, b = restore_latest(config, straight), restore_latest(config, resumed)
  assert int(a.step) == int(b.step) == 4
  _leaves_equal(a, b)  # params, ema, opt state, queue, ids, pointer, rng, step (= data position)
  ids = np.asarray(b.queue.ids)  # 4 pushes of 8 into 12 slots: step 2's last 4 ids, step 3's 8, oldest at ptr
  run = run_inputs.prepare(config)
  want = np.concatenate([run.batches.global_sentence_ids(s) for s in (2, 3)])
  np.testing.assert_array_equal(ids, np.roll(want[4:], int(b.queue.ptr)))


@pytest.mark.slow  # two tiny trainings, ~25 s on an idle 2-core CPU
def test_a_checkpoint_resumes_under_another_dropout_generator(tmp_path, minilm_dir, caplog):
  """docs/precision.md: checkpoints resume across model.rng_impl (the train state's threefry key seeds
  either generator), here with a longer run too: one line for each change, then the steps left."""
  config = tiny_training_config(tmp_path, minilm_dir, num_train_steps=2, checkpoint_every=2)
  workdir = str(tmp_path / "switched")
  trainer.train_and_evaluate(config, workdir)
  config.model.rng_impl, config.num_train_steps = "rbg", 3
  with caplog.at_level(logging.WARNING):
    trainer.train_and_evaluate(config, workdir)  # refused before: "differing fields: model.rng_impl"
  notes = sorted(r.getMessage() for r in caplog.records if "changes on resume" in r.getMessage())
  assert len(notes) == 2
  assert notes[0].startswith("model.rng_impl changes on resume ('threefry' -> 'rbg'): the dropout masks")
  assert notes[1].startswith("num_train_steps changes on resume (2 -> 3): the learning rate's linear decay")
  assert int(restore_latest(config, workdir).step) == 3


def test_a_workdir_of_an_unknown_state_layout_is_refused_in_one_line(tmp_path, minilm_dir, monkeypatch):
  """The queue as loose fields beside the flat optimizer state (a development layout) is neither this
  release's layout nor an older one that is converted: resume refuses it in one line and touches nothing."""
  config = tiny_training_config(tmp_path, minilm_dir)  # 4 steps, stopped after its step-2 save
  workdir = str(tmp_path / "old")
  train_preempted_after_first_save(trainer, checkpoint, monkeypatch, config, workdir)
  state = restore_latest(config, workdir)
  assert int(state.step) == 2
  rewrite_in_old_layout(workdir, state.replace(opt_state=in_flat_layout(state.opt_state)))
  with pytest.raises(CheckpointError) as error:
    trainer.train_and_evaluate(config, workdir)
  message = str(error.value)
  assert "\n" not in message and "another train-state layout" in message and "opt_state/inner_state/1/0/mu" in message
  rolling = os.path.join(workdir, workdir_lib.ROLLING_DIR)
  assert sorted(n for n in os.listdir(rolling) if n.isdigit()) == ["2"]  # nothing set aside, nothing written
  step, params = workdir_lib.restore_params(workdir, "latest")  # its params stay readable
  assert step == 2
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, minilm_dir):
  config = tiny_training_config(tmp_path, minilm_dir, checkpoint_every=1)  # 4 steps
  config.optim.learning_rate = 1e12
  config.optim.grad_clip_norm = 0.0
  config.optim.warmup_steps = 0
  workdir = str(tmp_path / "nan")
  with pytest.raises(trainer.NonFiniteLossError, match="non-finite loss"):
    trainer.train_and_evaluate(config, workdir)
  assert not [t for t in threading.enumerate() if t.name == "micse-prefetch"]  # the prefetch thread ended
  last = workdir_lib.rolling_manager(workdir, 2).latest_step()
  assert last is not None and last < config.num_train_steps
  state = restore_latest(config, workdir)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
