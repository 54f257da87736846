"""Data parallelism at any batch (issue 17): padded batches with masked rows, per-device AMI
sampling, and the step's collectives read from its optimised HLO on 4 fake CPU devices."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.augmentation.dropout_views import interleave_views, split_views
from micse_jax.losses import ami, ami_official
from micse_jax.losses.infonce import info_nce_loss
from micse_jax.training.data_parallel import padded_batch_size
from micse_jax.training.momentum import Queue
from tests.helpers import fake_devices_env
from tests.infonce_test import _np_infonce

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOUR_DEVICES = fake_devices_env(4)


def _worker(module, *args):
  out = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=FOUR_DEVICES,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("batch,devices,expected", [(50, 4, 52), (50, 8, 56), (64, 4, 64), (1, 3, 3), (7, 1, 7)])
def test_padded_batch_size_is_the_next_multiple_of_the_device_count(batch, devices, expected):
  assert padded_batch_size(batch, devices) == expected


def test_interleaved_views_keep_each_sentence_on_its_rows():
  v1 = {k: np.arange(6).reshape(3, 2) for k in ("input_ids", "attention_mask", "token_type_ids")}
  v2 = {k: 10 + np.arange(6).reshape(3, 2) for k in v1}
  both = interleave_views(v1, v2)["input_ids"]
  np.testing.assert_array_equal(both, [[0, 1], [10, 11], [2, 3], [12, 13], [4, 5], [14, 15]])
  att = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 3)))  # [L, 2B, ...]
  a1, a2 = split_views(att, axis=1)
  np.testing.assert_array_equal(a1, np.asarray(att)[:, 0::2])
  np.testing.assert_array_equal(a2, np.asarray(att)[:, 1::2])


def test_padding_rows_are_no_anchor_and_no_negative():
  rng = np.random.default_rng(3)
  z1, z2 = rng.normal(size=(2, 7, 8)).astype(np.float32)
  queue = rng.normal(size=(5, 8)).astype(np.float32)
  real = np.array([1, 1, 0, 1, 1, 0, 1])
  garbage1, garbage2 = z1.copy(), z2.copy()
  garbage1[real == 0], garbage2[real == 0] = 50.0, -3.0  # padding rows hold anything
  loss, metrics = jax.jit(info_nce_loss)(garbage1, garbage2, queue, row_mask=jnp.asarray(real))
  keep = real.astype(bool)
  ref, pos_cos, acc = _np_infonce(z1[keep], z2[keep], queue)
  np.testing.assert_allclose(loss, ref, rtol=1e-5)
  np.testing.assert_allclose(metrics["pos_cos"], pos_cos, rtol=1e-5)
  np.testing.assert_allclose(metrics["acc"], acc)
  n1, n2 = (z / np.linalg.norm(z, axis=1, keepdims=True) for z in (z1[keep], z2[keep]))
  cos = n1 @ n2.T
  np.testing.assert_allclose(metrics["neg_cos"], (cos.sum() - np.trace(cos)) / (5 * 4), rtol=1e-5)
  grads = jax.grad(lambda a, b: info_nce_loss(a, b, queue, row_mask=jnp.asarray(real))[0], (0, 1))(garbage1, garbage2)
  for g in grads:
    assert np.all(np.asarray(g)[~keep] == 0) and np.all(np.isfinite(g))


def test_padding_rows_are_never_enqueued():
  queue = Queue.empty(6, 2).replace(ptr=jnp.asarray(4, jnp.int32))
  rows = jnp.arange(10.0).reshape(5, 2)
  real = jnp.asarray([1, 0, 1, 1, 0])
  pushed = queue.push(rows, jnp.asarray([7, -1, 8, 9, -1]), real)
  q, v, ids, new_ptr = pushed.embeddings, pushed.valid, pushed.ids, pushed.ptr
  # real rows 0, 2, 3 go to slots 4, 5, 0 (ring); the pointer moves by 3
  np.testing.assert_array_equal(q, [[6, 7], [0, 0], [0, 0], [0, 0], [0, 1], [4, 5]])
  np.testing.assert_array_equal(v, [True, False, False, False, True, True])
  np.testing.assert_array_equal(ids, [9, -1, -1, -1, 7, 8])
  assert int(new_ptr) == 1


@pytest.mark.parametrize("variant", ["paper", "official"])
def test_ami_padding_rows_change_nothing_and_sampling_is_per_sentence(variant):
  """Sentence b samples with fold_in(key, b): the real rows of a padded batch give the unpadded
  batch's samples, MI and loss; the padding rows count nowhere."""
  rng = np.random.default_rng(5)
  att = rng.dirichlet(np.ones(6), size=(2, 2, 5, 4, 6)).astype(np.float32)  # [views, L, B, H, T, T]
  att1, att2 = jnp.asarray(att[0]), jnp.asarray(att[1])
  mask = jnp.ones((5, 6), jnp.int32)
  key = jax.random.PRNGKey(1)
  options = dict(num_samples=12)
  loss_fn = ami.ami_loss if variant == "paper" else (lambda a, b, m, k, **kw: ami_official.official_ami_loss(a, b, k, **kw))
  ref_loss, ref_metrics = loss_fn(att1, att2, mask, key, **options)
  pad = lambda a, axis: jnp.concatenate([a, jnp.repeat(jnp.take(a, jnp.asarray([0, 0, 0]), axis=axis) * 0.5 + 0.1,
                                                      1, axis=axis)], axis=axis)
  real = jnp.asarray([1] * 5 + [0] * 3)
  loss, metrics = loss_fn(pad(att1, 1), pad(att2, 1), pad(mask, 0), key, row_mask=real, **options)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for name, value in ref_metrics.items():
    np.testing.assert_allclose(metrics[name], value, rtol=1e-5, err_msg=name)
  # sentence 3 samples with fold_in(key, 3), whatever else is in the batch
  full = ami.attention_mutual_information(pad(att1, 1), pad(att2, 1), pad(mask, 0), key, num_samples=12)
  valid = ami.cell_validity(att1, att2, mask)[3:4]
  noise = jax.random.gumbel(jax.random.fold_in(key, 3), valid.shape[1:])[None]
  np.testing.assert_array_equal(ami.top_k_cells(valid, noise, 12)[0], full.indices[3:4])


def test_compiled_step_moves_no_activations(tmp_path, minilm_dir):
  """Tiny BERT, 4 fake devices, global batch 10 (padded to 12): no all-to-all and no
  collective-permute in the optimised HLO, no all-gather larger than the gathered z."""
  result = _worker("tests.hlo_step_worker", tmp_path, minilm_dir, "--batch", 10)
  table = result["table"]
  assert result["num_devices"] == 4
  assert table["all-to-all"]["count"] == 0, table
  assert table["collective-permute"]["count"] == 0, table
  assert table["all-gather"]["count"] >= 1  # z for the in-batch negatives
  assert table["all-gather"]["max_bytes"] <= result["z_bytes"], table


@pytest.mark.slow  # train_test.test_four_cpu_devices_match_one_device covers 4 devices in the default run
def test_batch_50_on_4_devices_equals_1_device(tmp_path, minilm_dir):
  """The trainer's batches padded to 52 rows on 4 devices against the unpadded 50 rows on one
  device: params, EMA, queue and every metric, 3 steps, to float32 reduction order."""
  result = _worker("tests.padded_batch_worker", tmp_path, minilm_dir, "--steps", 3)
  assert result["max_state_diff"] < 1e-5
  assert result["queue_ids_1dev"] == result["queue_ids_4dev"]
  assert result["queue_ptr"] == [(3 * 50) % 120] * 2
  assert -1 not in result["queue_ids_4dev"]
  for name, diff in result["metric_diffs"].items():
    scale = max(abs(m[name]) for m in result["metrics_1dev"])
    assert diff <= 1e-5 * max(scale, 1.0), (name, diff)
  assert all(m["ami_pairs"] == 1.0 for m in result["metrics_1dev"])
