"""Half-precision weight copies in the train state (`training/weight_copies.py`): exactly the
Dense kernels, cast as the model casts them; the gradient through a copy is the cast's; bfloat16
train steps reading the copies equal steps casting inside the step; checkpoints leave the copies
out and a restore rebuilds them (so workdirs written with or without them resume either way)."""
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from micse_jax import workdir as workdir_lib
from micse_jax.training import checkpoint, update, weight_copies
from micse_jax.training.state import create_train_state
from tests.helpers import run_device_worker
from tests.update_step_test import differences, step_config, train


def _params(key=0):
  k = jax.random.split(jax.random.PRNGKey(key), 5)
  return {"encoder": {"layer": {"dense": {"kernel": jax.random.normal(k[0], (6, 4)), "bias": jax.random.normal(k[1], (4,))},
                                "LayerNorm": {"scale": jax.random.normal(k[2], (4,))}},
                      "embeddings": {"embedding": jax.random.normal(k[3], (9, 6))}},
          "head": {"dense": {"kernel": jax.random.normal(k[4], (4, 4))}}}


def _state(compute_dtype, params=None):
  return create_train_state(params or _params(), optax.sgd(0.1), seed=0, momentum=True, queue_size=4, dim=4,
                            compute_dtype=compute_dtype)


def test_copies_are_the_encoder_and_ema_kernels_cast_and_nothing_else():
  params = _params()
  state = _state(jnp.bfloat16, params)
  copies = state.compute_weights
  assert sorted(copies) == ["ema", "encoder"]
  for name in ("encoder", "ema"):
    leaves = jax.tree_util.tree_leaves_with_path(copies[name])
    assert [jax.tree_util.keystr(p) for p, _ in leaves] == ["['layer']['dense']['kernel']"]
    expected = np.asarray(params["encoder"]["layer"]["dense"]["kernel"]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(leaves[0][1]), expected)
  assert _state(jnp.float16).compute_weights["encoder"]["layer"]["dense"]["kernel"].dtype == jnp.float16
  assert _state(jnp.float32).compute_weights == {} and _state(None).compute_weights == {}


def test_ct_second_encoder_has_copies_and_is_read_through_them():
  """Contrastive Tension's `encoder_b` casts its kernels like the online encoder: it gets copies too."""
  params = dict(_params(), encoder_b=_params(key=1)["encoder"])
  copies = _state(jnp.bfloat16, params).compute_weights
  assert sorted(copies) == ["ema", "encoder", "encoder_b"]
  expected = np.asarray(params["encoder_b"]["layer"]["dense"]["kernel"]).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(copies["encoder_b"]["layer"]["dense"]["kernel"]), expected)
  read = weight_copies.read_through(params, copies)
  for name in ("encoder", "encoder_b"):
    assert read[name]["layer"]["dense"]["kernel"].dtype == jnp.bfloat16
  assert read["head"]["dense"]["kernel"].dtype == jnp.float32  # the heads cast in the step (documented)


def test_the_gradient_through_a_copy_is_the_gradient_through_the_cast():
  params = _params()["encoder"]
  copies = weight_copies.kernel_copies(params, jnp.bfloat16)
  x = jax.random.normal(jax.random.PRNGKey(7), (3, 6)).astype(jnp.bfloat16)

  def loss(tree, cast):
    kernel = tree["layer"]["dense"]["kernel"]
    kernel = kernel.astype(jnp.bfloat16) if cast else kernel
    y = jnp.dot(x, kernel).astype(jnp.float32) * tree["layer"]["LayerNorm"]["scale"]
    return jnp.sum(jnp.sin(y)) + jnp.sum(tree["embeddings"]["embedding"] ** 2)

  ours = jax.grad(lambda p: loss(weight_copies.substituted(p, copies), cast=False))(params)
  reference = jax.grad(lambda p: loss(p, cast=True))(params)
  assert jax.tree.map(lambda g: g.dtype, ours) == jax.tree.map(lambda g: g.dtype, params)  # float32
  jax.tree.map(np.testing.assert_array_equal, ours, reference)


def test_a_stale_copy_is_what_the_forward_reads():
  """The forward reads the copy, not the parameter: the update must recast the copies where weights
  change (`update.apply` does, from the new weights)."""
  params = {"dense": {"kernel": jnp.ones((2, 2))}}
  copies = {"dense": {"kernel": jnp.full((2, 2), 3.0, jnp.bfloat16)}}
  used = weight_copies.substituted(params, copies)["dense"]["kernel"]
  assert used.dtype == jnp.bfloat16 and float(used[0, 0]) == 3.0
  state = _state(jnp.bfloat16)
  moved = jax.tree.map(lambda p: p + 1.0, state.params)
  result = update.apply(update.Inputs(inner=optax.sgd(0.5), grads=moved, params=state.params, opt_state=state.opt_state,
                                      max_norm=None, ema_params=state.ema_params, ema_decay=0.5,
                                      copies=state.compute_weights))
  kernel = np.asarray(_params()["encoder"]["layer"]["dense"]["kernel"])
  np.testing.assert_array_equal(np.asarray(result.copies["encoder"]["layer"]["dense"]["kernel"]),
                                (kernel - np.float32(0.5) * (kernel + np.float32(1))).astype(jnp.bfloat16))


def _both(config, shard_state=False):
  """20 steps with the copies and 20 casting in the step (`weight_copies.of` giving none)."""
  with_copies, norms = train(config, shard_state)
  with mock.patch.object(weight_copies, "of", lambda *args: {}):
    cast_in_step, ref_norms = train(config, shard_state)
  assert with_copies.compute_weights and not cast_in_step.compute_weights
  # after 20 steps the copies are still the weights cast (online encoder and EMA)
  fresh = weight_copies.of(with_copies.params, with_copies.ema_params, config.model.dtype)
  jax.tree.map(np.testing.assert_array_equal, with_copies.compute_weights, fresh)
  return with_copies, norms, cast_in_step, ref_norms


def compare(config, shard_state=False) -> dict:
  """`update_step_test.differences` of `_both`'s two runs, and of their gradient norms (the 4-device worker)."""
  new, norms, ref, ref_norms = _both(config, shard_state)
  return dict(differences(new, ref), norm=float(np.max(np.abs(np.subtract(norms, ref_norms)))))


@pytest.mark.parametrize("variant,arg,dtype", [("micse", None, "bfloat16")] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("micse", None, "float16"), ("ct", None, "bfloat16"), ("informin", "mlm", "bfloat16"),
        ("infocse", None, "bfloat16"), ("add", "rollout,dynamic", "bfloat16")]])
def test_steps_reading_the_copies_equal_steps_casting_in_the_step(tmp_path, tiny_real_dir, variant, arg, dtype):
  config = step_config(tmp_path, tiny_real_dir, variant, arg, {"model.dtype": dtype})
  with_copies, norms, cast_in_step, ref_norms = _both(config)
  np.testing.assert_array_equal(norms, ref_norms)
  jax.tree.map(np.testing.assert_array_equal, weight_copies.dropped(with_copies), cast_in_step)


@pytest.mark.slow  # a 4-device subprocess: micse and simcse in bfloat16, shard_state on and off
def test_steps_reading_the_copies_equal_steps_casting_in_the_step_on_four_devices(tmp_path, tiny_real_dir):
  results = run_device_worker("tests.step_equality_worker", tmp_path, tiny_real_dir, "tests.weight_copies_test",
                              "bfloat16")
  assert results.pop("num_devices") == 4 and len(results) == 4
  print(results)
  for result in results.values():
    assert all(value == 0.0 for value in result.values()), result


def test_checkpoints_leave_the_copies_out_and_restores_rebuild_them(tmp_path):
  state = _state(jnp.bfloat16)
  manager = workdir_lib.rolling_manager(str(tmp_path / "wd"), 2)
  checkpoint.save_state(manager, state)
  manager.wait_until_finished()
  reader = workdir_lib.step_reader(str(tmp_path / "wd" / workdir_lib.ROLLING_DIR))
  try:
    saved = checkpoint.state_layout(reader.item_metadata(0).tree)
  finally:
    reader.close()
  assert saved == checkpoint.state_layout(_state(jnp.float32))  # the layout without copies
  assert not any(name.startswith("compute_weights") for name in saved)
  abstract = jax.eval_shape(lambda: _state(jnp.bfloat16))
  restored = checkpoint.resume(manager, abstract)
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  assert restored.compute_weights["ema"]["layer"]["dense"]["kernel"].dtype == jnp.bfloat16
  # a float32 run resumes from the same workdir without copies
  assert checkpoint.resume(manager, jax.eval_shape(lambda: _state(jnp.float32))).compute_weights == {}
