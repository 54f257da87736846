"""The flat optimizer (`training/optim.py`): clipping + AdamW over one padded buffer equals
today's per-leaf `optax.chain(clip_by_global_norm, adamw)` — numerically on a random tree, over
20 train steps of every config (params, EMA, Adam moments, queue; 1 and 4 devices, `shard_state`
on and off), and older per-leaf checkpoints resume converted."""

import jax
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from micse_jax.training import optim
from tests.helpers import run_device_worker
from tests.methods_test import _config

STEPS = 20
# float32: one flat reduction instead of per-leaf partial sums changes the last bits of the clipping
# norm; 20 Adam steps at lr 1e-3 (a parameter moves by up to 2e-2) amplify that to at most 1e-5 in most
# configs and 1.8e-4 in ami_ct (two encoders) as measured: the bound is 1 % of the largest move.
ATOL = 2.5e-4
ADAM_ATOL = 1e-6  # mu, nu (measured ≤ 1e-7)
# The attention key bias has an exactly zero gradient (softmax shift invariance): its float32 gradient
# is rounding noise, which Adam normalises to steps of about lr, so any change of summation order moves
# it by up to lr per step (measured 1.3e-4 after 20 steps). Only a bound there.
KEY_BIAS = "['key']['bias']"
KEY_BIAS_ATOL = 1e-3 * STEPS
# float16 compute rounds activations to 2^-11: the runs' last-bit differences grow to ~5e-3 in 20 steps
# (measured 5.6e-3); the skipped steps (non-finite gradients) must be the same ones.
FLOAT16 = {"state": 2e-2, "mu": 1e-3, "norm": 1e-2}  # measured 5.6e-3, 1e-4, 1.5e-3 (norm: relative)
FAST = [("micse", None, {})]
SLOW = [("micse", None, {"model.dtype": "float16"}), ("simcse", None, {}),
        ("ami_simcse", None, {}), ("moco_simcse", None, {}), ("add", "rollout,dynamic", {}),
        ("informin", "mlm", {}), ("infocse", None, {}), ("ct", None, {}), ("ami_ct", None, {}), ("mirror", None, {}),
        ("ami_mirror", None, {}), ("positive_only", None, {}), ("ami_positive_only", None, {})]


def reference_tx(config) -> optax.GradientTransformation:
  """Today's optimizer, written independently: per-leaf clipping then AdamW."""
  o = config.optim
  return optax.chain(optax.clip_by_global_norm(o.grad_clip_norm),
                     optax.adamw(optim.learning_rate_schedule(config), b1=o.b1, b2=o.b2, eps=o.eps,
                                 weight_decay=o.weight_decay))


def step_config(tmp_path, model_dir, variant, arg, overrides):
  """`_config` for 20 steps with clipping that bites and weight decay on."""
  c = _config(tmp_path, model_dir, variant, arg)
  c.num_train_steps, c.optim.warmup_steps, c.optim.weight_decay, c.optim.grad_clip_norm = STEPS, 3, 0.01, 0.5
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def train(config, tx, shard_state=False):
  """20 jitted, donated steps of `make_train_step` with `tx` over this process's devices."""
  from micse_jax.training import mesh as mesh_lib
  from micse_jax.training import setup
  from micse_jax.training.step import make_train_step
  run = setup.prepare(config)
  mesh = mesh_lib.data_mesh()
  state = setup.initial_state(run, tx)
  shardings = mesh_lib.state_sharding(state, mesh, shard_state, 1024)
  step = jax.jit(make_train_step(config, run.nets, tx, optim.learning_rate_schedule(config), mesh),
                 in_shardings=(shardings, mesh_lib.batch_sharded(mesh)), out_shardings=(shardings, None),
                 donate_argnums=0)
  state, norms = jax.device_put(state, shardings), []
  for i in range(STEPS):
    state, metrics = step(state, mesh_lib.global_batch(run.batches.batch(i), mesh))
    norms.append(float(metrics["grad_norm"]))
  return jax.device_get(state), norms


def differences(new, ref) -> dict:
  """Max |new − ref| per part: the state without the optimizer leaf by leaf, Adam's mu/nu raveled."""
  drop = lambda s: s.replace(opt_state=None, compute_weights={})  # the copies: tests/compute_weights_test.py
  a, b = jax.tree_util.tree_leaves_with_path(drop(new)), jax.tree_util.tree_leaves_with_path(drop(ref))
  assert [p for p, _ in a] == [p for p, _ in b]
  out = {"state": 0.0, "key_bias": 0.0}
  for (path, x), (_, y) in zip(a, b):
    x, y = np.asarray(x), np.asarray(y)
    if np.issubdtype(x.dtype, np.floating):
      part = "key_bias" if KEY_BIAS in jax.tree_util.keystr(path) else "state"
      out[part] = max(out[part], float(np.max(np.abs(x.astype(np.float64) - y), initial=0.0)))
    else:
      np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
  adam = [s for s in jax.tree.leaves(ref.opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu")][0]
  new_adam = [s for s in jax.tree.leaves(new.opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu")][0]
  assert int(new_adam.count) == int(adam.count) >= STEPS - 3  # float16: the first steps may be skipped
  for name in ("mu", "nu"):
    flat, n = np.asarray(getattr(new_adam, name)), ravel_pytree(getattr(adam, name))[0].size
    assert flat.size % optim.FLAT_ALIGN == 0 and not np.any(flat[n:])  # the padding stays zero
    out[name] = float(np.max(np.abs(flat[:n] - np.asarray(ravel_pytree(getattr(adam, name))[0]))))
  return out


def compare(config, shard_state=False) -> dict:
  """The new step's and today's 20-step runs: max differences and the gradient norms."""
  new, new_norms = train(config, optim.make_optimizer(config), shard_state)
  ref, ref_norms = train(config, reference_tx(config), shard_state)
  finite = np.isfinite(ref_norms)  # float16: a skipped step's gradient norm is not finite
  np.testing.assert_array_equal(np.isfinite(new_norms), finite)
  new_norms, ref_norms = np.asarray(new_norms)[finite], np.asarray(ref_norms)[finite]
  return dict(differences(new, ref), norm=float(np.max(np.abs(new_norms - ref_norms))),
              max_grad_norm=float(np.max(ref_norms)), skipped=int(np.sum(~finite)))


def check(result: dict, clipped: bool = False, float16: bool = False) -> None:
  """The bounds above; `clipped`: clipping (0.5) must have been active in some step."""
  print(result)
  assert result["max_grad_norm"] > 0.5 or not clipped
  assert result["state"] <= (FLOAT16["state"] if float16 else ATOL), result
  assert max(result["mu"], result["nu"]) <= (FLOAT16["mu"] if float16 else ADAM_ATOL), result
  assert result["key_bias"] <= KEY_BIAS_ATOL, result
  assert result["norm"] <= (FLOAT16["norm"] if float16 else 1e-4) * result["max_grad_norm"], result


def test_flat_adamw_equals_optax_adamw_on_a_tree():
  """`optim.flat(clip → adamw)` vs per-leaf optax, 5 steps on a random tree (weight decay, clipping)."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"a": {"kernel": jax.random.normal(keys[0], (7, 3))}, "b": jax.random.normal(keys[1], (5,))}
  inner = lambda: optax.chain(optax.clip_by_global_norm(0.3), optax.adamw(1e-2, weight_decay=0.1))
  flat, ref = optim.flat(inner()), inner()
  fs, rs, fp, rp = flat.init(params), ref.init(params), params, params
  for i in range(5):
    grads = jax.tree.map(lambda p, k=jax.random.fold_in(keys[2], i): jax.random.normal(k, p.shape) * 3, params)
    fu, fs = flat.update(grads, fs, fp)
    ru, rs = ref.update(grads, rs, rp)
    fp, rp = optax.apply_updates(fp, fu), optax.apply_updates(rp, ru)
    np.testing.assert_allclose(optim.global_grad_norm(grads), optax.global_norm(grads), rtol=1e-6)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), fp, rp)
  mu = fs.inner_state[1][0].mu
  assert mu.shape == (optim.FLAT_ALIGN,)
  np.testing.assert_allclose(mu[:26], ravel_pytree(rs[1][0].mu)[0], rtol=1e-5, atol=1e-8)
  # an old per-leaf state converts to the flat one
  converted = optim.legacy_to_flat(rs)
  assert jax.tree.structure(converted) == jax.tree.structure(fs)
  np.testing.assert_allclose(converted.inner_state[1][0].nu, fs.inner_state[1][0].nu, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("variant,arg,overrides", FAST)
def test_flat_step_equals_per_leaf_step(tmp_path, tiny_real_dir, variant, arg, overrides):
  check(compare(step_config(tmp_path, tiny_real_dir, variant, arg, overrides)), clipped=True)


@pytest.mark.slow
@pytest.mark.parametrize("variant,arg,overrides", SLOW)
def test_flat_step_equals_per_leaf_step_for_every_config(tmp_path, tiny_real_dir, variant, arg, overrides):
  result = compare(step_config(tmp_path, tiny_real_dir, variant, arg, overrides))
  check(result, float16=bool(overrides))
  assert result["skipped"] > 0 or not overrides  # float16: the finite check did skip steps


@pytest.mark.slow  # a 4-device subprocess: micse and simcse, shard_state on and off
def test_flat_step_equals_per_leaf_step_on_four_devices(tmp_path, tiny_real_dir):
  results = run_device_worker("tests.step_equality_worker", tmp_path, tiny_real_dir, "tests.flat_update_test")
  assert results.pop("num_devices") == 4 and len(results) == 4
  for result in results.values():
    check(result, clipped=True)


@pytest.mark.slow  # 24 s of the default run (CI budget)
def test_old_per_leaf_workdir_resumes_converted(tmp_path, tiny_real_dir, monkeypatch):
  """A workdir saved as the previous release did (per-leaf optimizer state, the queue as loose
  fields; 3 steps) resumes under this one to step 6,
  equal to a run that was flat from the start; a non-convertible checkpoint stays one error line."""
  from micse_jax.training import checkpoint, program, trainer
  from micse_jax.training.setup import prepare
  from tests.sharded_state_worker import final_state, flat_state
  from tests.train_utils import rewrite_in_old_layout
  config = step_config(tmp_path, tiny_real_dir, "micse", None, {"checkpoint_every": 3})
  config.num_train_steps = 6
  flat_dir, old_dir = str(tmp_path / "flat"), str(tmp_path / "old")
  trainer.train_and_evaluate(config, flat_dir)
  with monkeypatch.context() as m:  # the trainer as it was: per-leaf optimizer state
    m.setattr(program, "make_optimizer", optim.per_leaf_optimizer)
    config.num_train_steps = 3
    trainer.train_and_evaluate(config, old_dir)
    old_run = prepare(config)
    old_state = final_state(old_run, optim.per_leaf_optimizer(config), old_dir, shard_state=False)
  rewrite_in_old_layout(old_dir, old_state)  # and the queue as loose fields, as releases before saved it
  config.num_train_steps = 6
  trainer.train_and_evaluate(config, old_dir)  # resumes at 3, converting
  run = prepare(config)
  resumed = flat_state(final_state(run, optim.make_optimizer(config), old_dir, shard_state=False))
  straight = flat_state(final_state(run, optim.make_optimizer(config), flat_dir, shard_state=False))
  assert sorted(resumed) == sorted(straight) and any("inner_state" in k for k in resumed)
  for k in straight:
    np.testing.assert_allclose(resumed[k], straight[k], rtol=0, atol=KEY_BIAS_ATOL if KEY_BIAS in k else ATOL,
                               err_msg=k)
  # without the conversion the old layout is refused with one CheckpointError line
  from micse_jax import workdir as workdir_lib
  from micse_jax.errors import CheckpointError
  abstract = jax.eval_shape(lambda: trainer.initial_state(run, optim.make_optimizer(config)))
  with pytest.raises(CheckpointError) as error:
    checkpoint.restore_state(workdir_lib.rolling_manager(old_dir, 2), abstract, step=3)
  assert "\n" not in str(error.value)
