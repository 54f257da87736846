"""GradCache (`chunk_size`, training/grad_cache.py): the step in blocks of rows is the whole batch's step.

Each method's step at batch 16 in blocks of 4 rows is compared with the same step unblocked (the
reference: the whole batch in one forward and one backward, `jax.value_and_grad` of the loss): the
gradient, the loss and every metric, and after a few steps the whole train state. The draws are checked
bit for bit against the whole batch's: the dropout masks of a block (`models/row_block.py`) against the
rows of `flax.linen.Dropout`'s draw over the batch, and AMI's samples of a block against the samples of
the batch's rows.
"""
import json

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


def _gradients(config, sizes=(0, 4), devices=None):
  """[(loss, metrics), gradient] of the program's loss at its step-0 state, for each `chunk_size` of
  `sizes`, by the step's own grad function (`step.gradient_function`: unblocked for 0, else blocked), on
  the first batch, on `devices` (default: all); one program prepared, one compile for all sizes."""
  from micse_jax.training import data_parallel
  from micse_jax.training import step as step_module
  prog, runs = prepared_program(config, devices)
  state = prog.initial_state(runs)
  packed = prog.place_batch([r.batches.batch(0) for r in runs])
  loss_fn = step_module.make_loss_fn(prog.config, prog.nets, prog.mesh)
  keys = step_module.step_keys(state.rng, state.step)
  rows, devices = prog.rows, prog.mesh.size

  def run(state, packed):
    batch, out = prog.layout.unpack(packed[0]), []
    for size in sizes:
      blocked = _blocked(prog.config, size)
      fn = step_module.gradient_function(blocked, prog.nets, loss_fn, state.compute_weights, {},
                                         grad_cache.blocks_per_device(blocked, rows, devices), devices,
                                         data_parallel.rows_per_device(prog.mesh))
      out.append(fn(state.params, state.frozen_params, batch, state.queue, keys, state.step))
    return out
  return jax.device_get(jax.jit(run)(state, packed))


def _compare_gradients(config, devices=None):
  ((loss, metrics), grads), ((b_loss, b_metrics), b_grads) = _gradients(config, (0, 4), devices)
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


@pytest.mark.slow  # ~25 s; InfoCSE's blocked step (after pre-training) is in the default run
def test_infocse_pretraining_phase_blocked_is_its_term_alone(tmp_path, minilm_dir):
  config = _variant_config(tmp_path, minilm_dir, "infocse")
  config.infocse.pretrain_steps = 5
  _compare_gradients(config)


@pytest.mark.slow  # ~50 s: two programs, 3 steps each; the default run compares the gradient and every metric
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


def _matrix_product_flops(fn, *args) -> float:
  """The products' FLOPs of one call of the compiled `fn`, each loop's body counted for its trips
  (`aot/kernel_cost.py`; XLA's own count takes a loop's body once)."""
  from micse_jax.aot import hlo_module, kernel_cost
  compiled = jax.jit(fn).lower(*args).compile()
  return sum(c.runs * c.flops for c in kernel_cost.costs(hlo_module.parse(compiled.as_text())))


def test_the_last_blocks_forward_runs_once(tmp_path, minilm_dir):
  """The blocked step's products beyond the unblocked step's are the forward of all blocks but the last
  (GradCache runs every block's forward twice; the last block's is kept from pass 1): with 4 blocks,
  3/4 of the whole batch's forward."""
  from micse_jax.training import data_parallel, weight_copies
  from micse_jax.training import step as step_module
  prog, runs = prepared_program(_config(tmp_path, minilm_dir, "simcse"))
  state = prog.initial_state(runs)
  packed = prog.place_batch([r.batches.batch(0) for r in runs])
  loss_fn = step_module.make_loss_fn(prog.config, prog.nets, prog.mesh)
  keys = step_module.step_keys(state.rng, state.step)
  args = lambda s, p: (s.params, s.frozen_params, prog.layout.unpack(p[0]), s.queue, keys, s.step)
  forward = _matrix_product_flops(
      lambda s, p: loss_fn(weight_copies.read_through(s.params, s.compute_weights), *args(s, p)[1:]), state, packed)
  step_flops = {}
  for size in (0, 4):
    config = _blocked(prog.config, size)
    fn = step_module.gradient_function(config, prog.nets, loss_fn, state.compute_weights, {},
                                       grad_cache.blocks_per_device(config, prog.rows, 1), 1,
                                       data_parallel.rows_per_device(prog.mesh))
    step_flops[size] = _matrix_product_flops(lambda s, p: fn(*args(s, p)), state, packed)
  assert forward > 0
  np.testing.assert_allclose(step_flops[4] - step_flops[0], 3 / 4 * forward, rtol=0.01)


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


KERNEL_HEADS, KERNEL_RATE = 2, 0.3


def kernel_inputs():
  """(projection `[8, 16, 3·heads·32]`, biases, key mask, key words) of 8 sentences of varied lengths, and
  the whole batch's context by `reference` (the explicit path, `jax.random.bernoulli`'s draw)."""
  from micse_jax.kernels import dropout_attention as da
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  length, head_dim = 16, 32
  projection = jax.random.normal(keys[0], (8, length, 3 * KERNEL_HEADS * head_dim), jnp.float32)
  biases = tuple(jax.random.normal(k, (KERNEL_HEADS * head_dim,)) for k in jax.random.split(keys[1], 3))
  key_mask = jnp.arange(length)[None, :] < jnp.array([16, 9, 3, 16, 12, 1, 16, 7])[:, None]
  words = jax.random.key_data(jax.random.PRNGKey(11))
  inputs = (projection, biases, key_mask, words)
  return inputs, np.asarray(da.reference(*inputs, KERNEL_RATE, KERNEL_HEADS))


def test_a_blocks_dropout_attention_kernel_draws_the_whole_batchs_bits_at_its_rows():
  """The Pallas kernels (interpreted) on a block of 2 rows of 8: the whole batch's context at those rows,
  the whole batch's Bernoulli draw (`reference`) deciding its dropout."""
  from micse_jax.kernels import dropout_attention as da
  (projection, biases, key_mask, words), whole = kernel_inputs()
  for index in range(4):
    rows = slice(2 * index, 2 * index + 2)
    part = da.dropout_attention(projection[rows], biases, key_mask[rows], words, KERNEL_RATE, KERNEL_HEADS,
                                interpret=True, rows=(jnp.int32(index), 4))
    _close(part, whole[rows], f"block {index}", rtol=1e-5, atol=1e-5)


def test_the_loss_scaled_blocked_gradient_is_the_unscaled_one(tmp_path, minilm_dir):
  """float16's loss scaling (`precision.value_and_unscaled_grad` per block): with a scale of 2^10 the
  blocked gradient is the one without scaling (float32: a power of two scales exactly)."""
  from micse_jax.training import data_parallel
  from micse_jax.training import step as step_module
  config = _blocked(_variant_config(tmp_path, minilm_dir, "simcse"), 4)
  prog, runs = prepared_program(config)
  state = prog.initial_state(runs)
  packed = prog.place_batch([r.batches.batch(0) for r in runs])
  keys = step_module.step_keys(state.rng, state.step)
  loss_fn = step_module.make_loss_fn(prog.config, prog.nets, prog.mesh)
  scale = {"scale": jnp.float32(2.0 ** 10), "counter": jnp.int32(0), "skipped_steps": jnp.int32(0)}

  def run(state, packed):
    out = []
    for scale_state in ({}, scale):
      fn = step_module.gradient_function(prog.config, prog.nets, loss_fn, state.compute_weights, scale_state, 4, 1,
                                         data_parallel.rows_per_device(prog.mesh))
      out.append(fn(state.params, state.frozen_params, prog.layout.unpack(packed[0]), state.queue, keys, state.step))
    return out
  ((loss, _), plain), ((scaled_loss, _), scaled) = jax.device_get(jax.jit(run)(state, packed))
  _close(scaled_loss, loss, "loss")
  for g, s in zip(jax.tree.leaves(plain), jax.tree.leaves(scaled)):
    _close(s, g, "gradient", rtol=1e-6)


@pytest.mark.slow  # ~60 s: a population of two, blocked and not; the blocked step is vmapped like any step
def test_a_population_blocked_trains_the_members_of_the_unblocked_population(tmp_path, minilm_dir):
  from tests.population_utils import run_population
  config = _variant_config(tmp_path, minilm_dir, "micse")
  config.population.seeds, config.population.ami_weights = (1, 2), (0.0, 0.3)
  plain, plain_history = run_population(config, 2)
  blocked, blocked_history = run_population(_blocked(config, 4), 2)
  for h, b in zip(plain_history, blocked_history):
    for name in ("loss", "grad_norm", "infonce", "ami"):
      _close(b[name], h[name], name, rtol=1e-4)
  for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(plain.members.params),
                               jax.tree_util.tree_leaves_with_path(blocked.members.params)):
    _close(y, x, jax.tree_util.keystr(path), rtol=1e-4, atol=1e-6)


RELATIVES = {
    "remat_full": ("micse", {"model.remat": "full"}),
    "ct": ("ct", {}),
    "add": ("add", {"model.init_mlm_head": True}),
    "mirror": ("mirror", {}),
    "positive_only": ("ami_positive_only", {}),
    "informin": ("informin", {}),
}


@pytest.mark.slow  # ~25 s each; the default run checks the blocked step on miCSE, SimCSE, the official AMI, MLM, InfoCSE
@pytest.mark.parametrize("name", sorted(RELATIVES))
def test_the_relatives_blocked_give_the_whole_batchs_loss_and_gradient(tmp_path, minilm_dir, name):
  variant, overrides = RELATIVES[name]
  _compare_gradients(_config(tmp_path, minilm_dir, variant, **overrides))


@pytest.mark.slow  # ~3 min: 8 programs on 4 fake devices; the default run checks one device
def test_on_four_devices_each_device_blocks_its_own_rows_and_the_step_is_unchanged(tmp_path, minilm_dir):
  from tests.helpers import run_device_worker
  out = run_device_worker("tests.grad_cache_devices_worker", tmp_path, minilm_dir, devices=4)
  assert out["micse"] == out["simcse"] == out["official_ami"] == "equal"
  assert out["kernel_block_difference"] < 1e-5
  assert out["state_difference"] < 1e-5


def test_a_checkpoint_knows_nothing_of_blocks(tmp_path, minilm_dir):
  """The blocked program's train state is the unblocked one's, leaf for leaf, and a workdir resumes
  under another `chunk_size` (one written before the field existed too) without a difference named."""
  from micse_jax import resume_checks
  config = _config(tmp_path, minilm_dir, "micse")
  shapes = [jax.tree.map(lambda s: (s.shape, s.dtype), prepared_program(_blocked(config, size))[0].abstract_state)
            for size in (0, 4)]
  assert shapes[0] == shapes[1]
  saved = json.loads(json.dumps(config.to_dict()))  # as the workdir's config.json holds it
  assert resume_checks.config_differences(saved, _blocked(config, 8).to_dict()) == []
  del saved["chunk_size"]
  assert resume_checks.config_differences(saved, _blocked(config, 4).to_dict()) == []
  assert resume_checks.config_differences(saved, dict(config.to_dict(), batch_size=32)) != []
