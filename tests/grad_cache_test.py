"""GradCache (`chunk_size`, training/grad_cache.py): the step in blocks of rows is the whole batch's step.

Each method's step at batch 16 in blocks of 4 rows is compared with the same step unblocked (the
reference: the whole batch in one forward and one backward, `jax.value_and_grad` of the loss): the
gradient, the loss and every metric, and after a few steps the whole train state. The draws are checked
bit for bit against the whole batch's: the dropout masks of a block (`models/row_block.py`) against the
rows of `flax.linen.Dropout`'s draw over the batch, and AMI's samples of a block against the samples of
the batch's rows.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.losses.ami import attention_mutual_information
from micse_jax.models import row_block
from micse_jax.models.dropout import Dropout
from micse_jax.training import grad_cache
from tests.train_utils import prepared_program, steps_of, tiny_training_config

RTOL = 1e-5


def _close(a, b, what, rtol=RTOL, atol=1e-7):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  np.testing.assert_allclose(a, b, rtol=rtol, atol=atol + rtol * float(np.max(np.abs(b), initial=0.0)),
                             err_msg=what)


def _config(tmp_path, tokenizer_dir, variant, **overrides):
  config = tiny_training_config(tmp_path, tokenizer_dir, variant, **overrides)
  config.batch_size, config.num_train_steps, config.optim.warmup_steps = 16, 3, 1
  config.momentum.queue_size = 24 if config.momentum.get("enabled", True) else config.momentum.queue_size
  return config


def _blocked(config, size: int):
  config = config.copy_and_resolve_references()
  config.chunk_size = str(size)
  return config


def _gradients(config, steps_done: int = 0):
  """(loss, metrics, gradient) of the program's loss at its step-0 state, by the step's own grad
  function (blocked or not, as `chunk_size` says), on the first batch."""
  from micse_jax.training import step as step_module
  from micse_jax.training import weight_copies
  prog, runs = prepared_program(config)
  state = prog.initial_state(runs)
  batch = prog.place_batch([r.batches.batch(0) for r in runs])
  loss_fn = step_module.make_loss_fn(prog.config, prog.nets, prog.mesh)
  keys = step_module.step_keys(state.rng, state.step)

  def run(state, packed):
    batch = prog.layout.unpack(packed[0])
    copies = state.compute_weights
    read = lambda p: weight_copies.read_through(p, copies)
    blocks = grad_cache.blocks_per_device(prog.config, batch["input_ids"].shape[0], prog.mesh.size)
    if blocks > 1:
      fn = grad_cache.value_and_unscaled_grad(prog.config, prog.nets, read, {}, blocks, prog.mesh.size,
                                              lambda fn, rows, shared: fn(*rows, *shared))
    else:
      fn = jax.value_and_grad(lambda p, *a: loss_fn(read(p), *a), has_aux=True)
    return fn(state.params, state.frozen_params, batch, state.queue, keys, state.step)
  return jax.device_get(jax.jit(run)(state, batch))


def _compare_gradients(config):
  (loss, metrics), grads = _gradients(config)
  (b_loss, b_metrics), b_grads = _gradients(_blocked(config, 4))
  _close(b_loss, loss, "loss")
  assert sorted(b_metrics) == sorted(metrics)
  for name in metrics:
    _close(b_metrics[name], metrics[name], name)
  for (path, g), (_, b) in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves_with_path(b_grads)):
    _close(b, g, jax.tree_util.keystr(path))
  assert any(float(np.max(np.abs(g))) > 0 for g in jax.tree.leaves(grads))
  return metrics


METHODS = {
    "micse": {},
    "simcse": {},
    "official_ami": {"ami.variant": "official", "ami.layers": (0, 1)},
    "infocse": {"model.init_mlm_head": True},
    "mlm": {"mlm.enabled": True, "model.init_mlm_head": True},
}


def _variant_config(tmp_path, tokenizer_dir, name):
  variant = {"official_ami": "micse", "mlm": "simcse"}.get(name, name)
  return _config(tmp_path, tokenizer_dir, variant, **METHODS[name])


@pytest.mark.parametrize("name", sorted(METHODS))
def test_blocks_of_four_rows_give_the_whole_batchs_loss_metrics_and_gradient(tmp_path, minilm_dir, name):
  metrics = _compare_gradients(_variant_config(tmp_path, minilm_dir, name))
  if name in ("micse", "official_ami"):
    assert float(metrics["ami_pairs"]) > 0  # the AMI term had pairs to count


def test_infocse_pretraining_phase_blocked_is_its_term_alone(tmp_path, minilm_dir):
  config = _variant_config(tmp_path, minilm_dir, "infocse")
  config.infocse.pretrain_steps = 5
  _compare_gradients(config)


def test_blocked_steps_train_the_same_state(tmp_path, minilm_dir):
  config = _variant_config(tmp_path, minilm_dir, "micse")
  runs = {}
  for size in (0, 4):
    prog, prepared = prepared_program(_blocked(config, size))
    runs[size] = steps_of(prog, prepared, 3)
  (_, state, history), (_, b_state, b_history) = runs[0], runs[4]
  for step, (m, b) in enumerate(zip(history, b_history)):
    for name in m:
      _close(b[name], m[name], f"step {step} {name}", rtol=1e-4)
  for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(state),
                               jax.tree_util.tree_leaves_with_path(b_state)):
    if np.issubdtype(np.asarray(x).dtype, np.floating):
      _close(y, x, jax.tree_util.keystr(path), rtol=1e-4, atol=1e-6)
    else:
      np.testing.assert_array_equal(y, x, err_msg=jax.tree_util.keystr(path))


class _Drop(nn.Module):
  random_bits: int = 32

  @nn.compact
  def __call__(self, x):
    return Dropout(rate=0.3, random_bits=self.random_bits)(x, deterministic=False)


@pytest.mark.parametrize("devices,random_bits", [(1, 32), (2, 32), (2, 16)])
def test_a_blocks_dropout_mask_is_the_whole_batchs_at_its_rows(devices, random_bits):
  x = jnp.ones((16, 5, 3))
  key = jax.random.PRNGKey(7)
  whole = np.asarray(_Drop(random_bits).apply({}, x, rngs={"dropout": key}) != 0)  # flax's draw (tests/dropout_test.py)
  rows = np.arange(16).reshape(devices, 4, 16 // devices // 4)  # device d's rows cut into 4 blocks
  for index in range(4):
    block = row_block.Block(jnp.int32(index), 4, devices)
    with row_block.applied(block):
      part = _Drop(random_bits).apply({}, x[: 16 // 4], rngs={"dropout": key})
    np.testing.assert_array_equal(np.asarray(part != 0), whole[rows[:, index].reshape(-1)])


def test_blocks_put_back_in_order_are_the_batch():
  x = jnp.arange(24 * 2).reshape(24, 2)
  for devices in (1, 2, 3):
    parts = jnp.stack([row_block.Block(jnp.int32(i), 4, devices).of_whole(x) for i in range(4)])
    np.testing.assert_array_equal(row_block.whole_of(parts, devices), x)


def test_a_blocks_ami_samples_are_the_whole_batchs_at_its_rows():
  rng = np.random.default_rng(0)
  att = [jnp.asarray(rng.dirichlet(np.ones(6), size=(2, 8, 4, 6)), jnp.float32) for _ in range(2)]
  mask = jnp.ones((8, 6), jnp.int32)
  key = jax.random.PRNGKey(3)
  whole = attention_mutual_information(att[0], att[1], mask, key, num_samples=5)
  for index in range(2):
    block = row_block.Block(jnp.int32(index), 2)
    part = attention_mutual_information(*(block.of_whole(a.swapaxes(0, 1)).swapaxes(0, 1) for a in att),
                                        block.of_whole(mask), key, num_samples=5,
                                        row_ids=block.of_whole(jnp.arange(8)))
    np.testing.assert_array_equal(part.indices, whole.indices[index * 4:(index + 1) * 4])
    np.testing.assert_array_equal(part.sample_weight, whole.sample_weight[index * 4:(index + 1) * 4])


def test_chunk_size_that_does_not_divide_the_batch_is_refused(tmp_path, minilm_dir):
  config = _config(tmp_path, minilm_dir, "simcse")
  with pytest.raises(ValueError, match="chunk_size=5 must divide the batch of 16"):
    grad_cache.blocks_per_device(_blocked(config, 5), 16, 1)
  assert grad_cache.blocks_per_device(_blocked(config, 16), 16, 1) == 1
  assert grad_cache.blocks_per_device(_blocked(config, 4), 16, 2) == 4
