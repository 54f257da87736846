"""The kernel diet (issue 26) changes no result: the fused query/key/value GEMM (`dense.fused_dense`)
equals three `nn.Dense` and its parameters initialise as theirs, and 20 train steps (params, EMA,
Adam moments, queue) equal those of the model and step as they were before the diet: one GEMM per
projection, flax's `nn.LayerNorm`, `jax.nn.gelu`, the kernels cast inside the step (no
`compute_weights` copies), on 1 and 4 devices, `shard_state` on and off, every config. The
LayerNorm itself: `tests/layer_norm_test.py`; the GELU: `tests/bert_test.py`; the copies:
`tests/compute_weights_test.py`."""
import contextlib
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.models import attention, bert, bert_config, dense
from micse_jax.training import compute_weights
from tests.helpers import run_device_worker
from tests.update_step_test import KEY_BIAS_ATOL, check, differences, step_config, train

WIDTHS = (16, 8, 16)
# bfloat16 compute (CPU): the fused GEMM may block its float32 accumulation differently, and a bfloat16
# activation that then rounds the other way moves by 2^-8 relative; 20 Adam steps grow that to (micse,
# measured) 6.0e-3 in the state, 5.4e-4 in mu, 1.0e-2 in the key bias, 1 % in a gradient norm.
BFLOAT16 = {"state": 2.5e-2, "mu": 2e-3, "norm": 3e-2}  # norm: relative
FAST = [("micse", None, {})]
SLOW = [("micse", None, {"model.dtype": "bfloat16"}), ("micse", None, {"model.dtype": "float16"}),
        ("simcse", None, {}), ("ami_simcse", None, {}),
        ("moco_simcse", None, {}), ("add", "rollout,dynamic", {}), ("informin", "mlm", {}), ("infocse", None, {}),
        ("ct", None, {}), ("ami_ct", None, {}), ("mirror", None, {}), ("ami_mirror", None, {}),
        ("positive_only", None, {}), ("ami_positive_only", None, {})]


def separate_dense(x, params, dtype):
  """The reference: one `nn.Dense` per parameter set, as the model ran before."""
  return tuple(nn.Dense(p["bias"].shape[0], dtype=dtype).apply({"params": p}, x) for p in params)


def flax_layer_norm(config, dtype, name="LayerNorm"):
  """The reference LayerNorm: flax's, as the model ran before."""
  return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=dtype, name=name)


def jax_gelu(x):
  """The reference GELU: `jax.nn.gelu`'s erfc form, as the model ran before."""
  return jax.nn.gelu(x, approximate=False)


@contextlib.contextmanager
def unfused_model():
  """The model and step as they were: separate query/key/value GEMMs, flax's LayerNorm, jax's GELU,
  no half-precision weight copies in the train state."""
  with mock.patch.object(attention, "fused_dense", separate_dense), mock.patch.object(bert, "_layer_norm", flax_layer_norm), \
       mock.patch.dict(bert_config.ACTIVATIONS, {"gelu": jax_gelu}), \
       mock.patch.object(compute_weights, "of", lambda *args: {}):
    yield


def _param_sets(key):
  keys = jax.random.split(key, 2 * len(WIDTHS))
  return [{"kernel": jax.random.normal(keys[2 * i], (12, w)), "bias": jax.random.normal(keys[2 * i + 1], (w,))}
          for i, w in enumerate(WIDTHS)]


def test_dense_params_initialise_as_nn_dense():
  init = nn.initializers.normal(stddev=0.02)
  ours = bert.DenseParams(8, init).init(jax.random.PRNGKey(3), 5)["params"]
  theirs = nn.Dense(8, kernel_init=init).init(jax.random.PRNGKey(3), jnp.zeros((1, 5)))["params"]
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_dense_equals_separate_dense_and_its_gradient(dtype):
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 12))
  params = _param_sets(jax.random.PRNGKey(1))
  fused, ref = dense.fused_dense(x, params, dtype), separate_dense(x, params, dtype)
  assert [y.shape for y in fused] == [(3, 5, w) for w in WIDTHS] and all(y.dtype == dtype for y in fused)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2  # float32: the dW GEMM sums the rows in another order
  for a, b in zip(fused, ref):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)
  loss = lambda f: lambda p: sum(jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in f(x, p, dtype))
  grads, ref_grads = jax.grad(loss(dense.fused_dense))(params), jax.grad(loss(separate_dense))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=tol, atol=tol), grads, ref_grads)


def _tiny_bert(dtype):
  config = bert.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=16)
  model = bert.BertModel(config, sow_attention_layers=(1,), dtype=dtype)
  ids = jax.random.randint(jax.random.PRNGKey(0), (3, 7), 1, 40)
  mask = jnp.ones((3, 7), jnp.int32).at[0, 5:].set(0)
  return model, model.init(jax.random.PRNGKey(1), ids, mask)["params"], ids, mask


def compare(config, shard_state=False) -> dict:
  """20 steps of this model and of `unfused_model`: max differences (`update_step_test.differences`)."""
  new, new_norms = train(config, shard_state)
  with unfused_model():
    ref, ref_norms = train(config, shard_state)
  finite = np.isfinite(ref_norms)
  np.testing.assert_array_equal(np.isfinite(new_norms), finite)
  new_norms, ref_norms = np.asarray(new_norms)[finite], np.asarray(ref_norms)[finite]
  return dict(differences(new, ref), norm=float(np.max(np.abs(new_norms - ref_norms))),
              max_grad_norm=float(np.max(ref_norms)), skipped=int(np.sum(~finite)))


def check_result(result: dict, dtype: str | None) -> None:
  """`update_step_test.check`'s float32 bounds; half precision: `BFLOAT16` (float16: its `FLOAT16`)."""
  if dtype == "bfloat16":
    print(result)
    assert result["state"] <= BFLOAT16["state"] and max(result["mu"], result["nu"]) <= BFLOAT16["mu"], result
    assert result["norm"] <= BFLOAT16["norm"] * result["max_grad_norm"], result
    assert result["key_bias"] <= KEY_BIAS_ATOL, result
  else:
    check(result, float16=dtype == "float16")


@pytest.mark.parametrize("variant,arg,overrides", FAST)
def test_step_equals_the_unfused_step(tmp_path, tiny_real_dir, variant, arg, overrides):
  config = step_config(tmp_path, tiny_real_dir, variant, arg, overrides)
  check_result(compare(config), overrides.get("model.dtype"))


@pytest.mark.slow
@pytest.mark.parametrize("variant,arg,overrides", SLOW)
def test_step_equals_the_unfused_step_for_every_config(tmp_path, tiny_real_dir, variant, arg, overrides):
  config = step_config(tmp_path, tiny_real_dir, variant, arg, overrides)
  check_result(compare(config), overrides.get("model.dtype"))


@pytest.mark.slow  # a 4-device subprocess: micse and simcse, shard_state on and off
def test_step_equals_the_unfused_step_on_four_devices(tmp_path, tiny_real_dir):
  results = run_device_worker("tests.step_equality_worker", tmp_path, tiny_real_dir, "tests.kernel_diet_test")
  assert results.pop("num_devices") == 4 and len(results) == 4
  for result in results.values():
    check_result(result, None)
