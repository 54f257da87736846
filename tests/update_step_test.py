"""The step's fused update (`training/update.py`) changes no result: 20 train steps of every config
(params, EMA, Adam moments, queue, the half-precision copies; 1 and 4 devices, `shard_state` on and
off; float16's skipped steps) equal, bit for bit where the programs allow it, the same steps with the
update written as it ran before the fusion — optax's chain(clip_by_global_norm, adamw).update per leaf, `apply_updates`, the
EMA, the copies recast, then a select over all of it — given the same gradient norm (with optax's
own norm, summed in another order, and with float16 compute or 4 devices, where XLA may sum the
backward's reductions in another order, to rounding); and workdirs of the older layouts (the previous
release's flat optimizer state; releases before it, with the queue as loose fields) resume converted
to the uninterrupted run, bit for bit."""
import contextlib
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from micse_jax.training import update, weight_copies
from micse_jax.training.momentum import ema_update
from tests.helpers import run_device_worker
from tests.methods_test import _config
from tests.train_utils import program_steps

STEPS = 20
# Bounds that other step-equality tests (`weight_copies_test`) share, for changes
# that reorder float32 sums (a GEMM blocked otherwise, a reduction split otherwise): 20 Adam steps at lr
# 1e-3 (a parameter moves by up to 2e-2) amplify a last-bit change of the clipping norm to at most 1e-5
# in most configs and 3.3e-4 in ami_ct (two encoders; JAX's autodiff of the LayerNorm on CPU), as
# measured: the bound is 2.5 % of the largest move.
ATOL = 5e-4
ADAM_ATOL = 1e-6  # mu, nu (measured ≤ 1e-7)
# The attention key bias has an exactly zero gradient (softmax shift invariance): its float32 gradient
# is rounding noise, which Adam normalises to steps of about lr, so any change of summation order moves
# it by up to lr per step (measured 1.3e-4 after 20 steps). Only a bound there.
KEY_BIAS = "['key']['bias']"
KEY_BIAS_ATOL = 1e-3 * STEPS
# float16 compute rounds activations to 2^-11: last-bit differences grow to ~5e-3 in 20 steps
# (measured 5.6e-3); the skipped steps (non-finite gradients) must be the same ones.
FLOAT16 = {"state": 2e-2, "mu": 1e-3, "norm": 1e-2}  # measured 5.6e-3, 1e-4, 1.5e-3 (norm: relative)
EXACT = {"state": 0.0, "mu": 0.0, "norm": 0.0}  # this module's comparison: the same arithmetic
FAST = [("micse", None, {})]
SLOW = [("micse", None, {"model.dtype": "float16"}), ("micse", None, {"model.dtype": "bfloat16"}),
        ("simcse", None, {}), ("ami_simcse", None, {}), ("moco_simcse", None, {}), ("add", "rollout,dynamic", {}),
        ("informin", "mlm", {}), ("infocse", None, {}), ("ct", None, {}), ("ami_ct", None, {}), ("mirror", None, {}),
        ("ami_mirror", None, {}), ("positive_only", None, {}), ("ami_positive_only", None, {})]


def reference_apply(u: update.Inputs, norm_fn=None):
  """The update as the step wrote it before the fused pass, with optax's own per-leaf chain: the
  norm (`optax.tree.norm`, or `norm_fn` in its place, also inside the clipping), clip → `inner`
  (`tx.update`), the member's scale, `apply_updates`, the EMA of the new encoder, the copies recast,
  then a select of all of it against the old state."""
  inner, grads, opt_state, params, max_norm = u.inner, u.grads, u.opt_state, u.params, u.max_norm
  ema_params, ema_decay, copies, keep, scale = u.ema_params, u.ema_decay, u.copies, u.keep, u.scale
  tx = inner if max_norm is None else optax.chain(optax.clip_by_global_norm(max_norm), inner)
  with mock.patch.object(optax.tree, "norm", norm_fn) if norm_fn else contextlib.nullcontext():
    norm = optax.tree.norm(grads)
    updates, new_state = tx.update(grads, opt_state, params)
  if scale is not None:
    updates = jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)
  new_params = optax.apply_updates(params, updates)
  new_ema = ema_update(new_params["encoder"], ema_params, ema_decay) if ema_decay is not None and ema_params \
      else ema_params
  new_copies = weight_copies.of(new_params, new_ema, weight_copies.dtype_of(copies)) if copies else copies
  keep = jnp.asarray(keep, bool) & (jnp.isfinite(norm) if u.skip_nonfinite else True)
  select = lambda new, old: jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)
  return update.Result(select(new_params, params), select(new_state, opt_state), select(new_ema, ema_params),
                       select(new_copies, copies), norm, keep)


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


def train(config, shard_state=False):
  """20 steps of the trainer's program (`tests/train_utils.program_steps`) over this process's
  devices, the state replicated or sharded (leaves of 1024 elements and more)."""
  config = config.copy_and_resolve_references()
  config.mesh.shard_state, config.mesh.shard_min_elements = shard_state, 1024
  _, state, history = program_steps(config, STEPS)
  return state, [float(m["grad_norm"]) for m in history]


def differences(new, ref) -> dict:
  """Max |new − ref| per part: the state leaf by leaf (the copies: `tests/weight_copies_test.py`),
  the key bias apart, Adam's mu and nu."""
  drop = lambda s: s.replace(opt_state=None, compute_weights={})
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
  adam = lambda s: [a for a in jax.tree.leaves(s.opt_state, is_leaf=lambda a: hasattr(a, "mu")) if hasattr(a, "mu")][0]
  assert int(adam(new).count) == int(adam(ref).count) >= STEPS - 3  # float16: the first steps may be skipped
  for name in ("mu", "nu"):
    pairs = zip(jax.tree.leaves(getattr(adam(new), name)), jax.tree.leaves(getattr(adam(ref), name)))
    out[name] = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)
  return out


def compare(config, shard_state=False, same_norm=True) -> dict:
  """The step's and the reference update's 20-step runs: max differences and the gradient norms.
  `same_norm`: the reference computes ‖g‖₂ as the step does (`update.global_norm`: the same terms
  summed in another order than optax's per-leaf sums), so that everything else must be bit for bit."""
  new, new_norms = train(config, shard_state)
  reference = functools.partial(reference_apply, norm_fn=update.global_norm if same_norm else None)
  with mock.patch.object(update, "apply", reference):
    ref, ref_norms = train(config, shard_state)
  copies = [float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
            for x, y in zip(jax.tree.leaves(new.compute_weights), jax.tree.leaves(ref.compute_weights))]
  finite = np.isfinite(ref_norms)  # float16: a skipped step's gradient norm is not finite
  np.testing.assert_array_equal(np.isfinite(new_norms), finite)
  new_norms, ref_norms = np.asarray(new_norms)[finite], np.asarray(ref_norms)[finite]
  return dict(differences(new, ref), norm=float(np.max(np.abs(new_norms - ref_norms))), copies=max(copies, default=0.0),
              max_grad_norm=float(np.max(ref_norms)), skipped=int(np.sum(~finite)))


def check(result: dict, clipped: bool = False, float16: bool = False, bounds: dict | None = None) -> None:
  """`bounds` (default: the float32 ones above, `FLOAT16` with `float16`); `clipped`: clipping (0.5)
  must have been active in some step."""
  print(result)
  bounds = bounds or (FLOAT16 if float16 else {"state": ATOL, "mu": ADAM_ATOL, "norm": 1e-4})
  assert result["max_grad_norm"] > 0.5 or not clipped
  assert result["state"] <= bounds["state"], result
  assert max(result["mu"], result["nu"]) <= bounds["mu"], result
  assert result["key_bias"] <= max(bounds["state"], KEY_BIAS_ATOL if bounds["state"] else 0.0), result
  assert result["norm"] <= bounds["norm"] * result["max_grad_norm"], result


@pytest.mark.parametrize("variant,arg,overrides", FAST)
def test_step_equals_the_per_leaf_optax_update(tmp_path, tiny_real_dir, variant, arg, overrides):
  check(compare(step_config(tmp_path, tiny_real_dir, variant, arg, overrides)), clipped=True, bounds=EXACT)


@pytest.mark.slow
def test_step_equals_the_per_leaf_optax_update_to_rounding_with_optax_norm(tmp_path, tiny_real_dir):
  """With optax's own norm in the reference: ‖g‖₂ differs in its last bits (measured 2.6e-5 of 11.6 at
  step 0: per-shape variadic sums against per-leaf sums), which the clipping carries into the state;
  the float32 bounds above hold."""
  result = compare(step_config(tmp_path, tiny_real_dir, "micse", None, {}), same_norm=False)
  check(result, clipped=True)
  assert 0 < result["norm"] <= 1e-5 * result["max_grad_norm"], result


@pytest.mark.slow
@pytest.mark.parametrize("variant,arg,overrides", SLOW)
def test_step_equals_the_per_leaf_optax_update_for_every_config(tmp_path, tiny_real_dir, variant, arg, overrides):
  float16 = overrides.get("model.dtype") == "float16"
  result = compare(step_config(tmp_path, tiny_real_dir, variant, arg, overrides))
  # float16: the two programs differ after the backward, and XLA:CPU may then sum some of the
  # backward's float16 reductions in another order (measured state 4.8e-3, within FLOAT16's rounding)
  check(result, float16=float16, bounds=None if float16 else EXACT)
  assert result["copies"] == 0.0 or float16
  assert result["skipped"] > 0 or not float16  # float16: steps were skipped


@pytest.mark.slow  # a 4-device subprocess: micse and simcse, shard_state on and off
def test_step_equals_the_per_leaf_optax_update_on_four_devices(tmp_path, tiny_real_dir):
  results = run_device_worker("tests.step_equality_worker", tmp_path, tiny_real_dir, "tests.update_step_test")
  assert results.pop("num_devices") == 4 and len(results) == 4
  for result in results.values():
    # across 4 devices XLA places the gradients' all-reduce by the program around it: float32 rounding
    # (measured state 2.2e-5), not bit for bit
    check(result, clipped=True)


@pytest.mark.slow  # ~25 s each of the default run (CI budget)
@pytest.mark.parametrize("layout", ["flat", "loose_queue"])
def test_older_workdir_resumes_converted(tmp_path, tiny_real_dir, layout, caplog):
  """A 3-step workdir rewritten by hand in the previous release's layout (flat optimizer state) or
  in the releases' before it (per-leaf moments, the queue as loose fields) is refused in one line
  without the conversion, and resumes under this release to step 6 equal, bit for bit, to a run of 6
  steps."""
  from micse_jax import workdir as workdir_lib
  from micse_jax.errors import CheckpointError
  from micse_jax.training import checkpoint, trainer
  from tests.sharded_state_worker import final_state, flat_state
  from tests.train_utils import in_flat_layout, prepared_program, rewrite_in_old_layout, rewrite_rolling
  config = step_config(tmp_path, tiny_real_dir, "micse", None, {"checkpoint_every": 3})
  config.num_train_steps = 6
  straight_dir, old_dir = str(tmp_path / "straight"), str(tmp_path / "old")
  trainer.train_and_evaluate(config, straight_dir)
  config.num_train_steps = 3
  trainer.train_and_evaluate(config, old_dir)
  state = final_state(config, old_dir)
  if layout == "flat":
    rewrite_rolling(old_dir, state.replace(opt_state=in_flat_layout(state.opt_state)))
  else:
    rewrite_in_old_layout(old_dir, state)
  with pytest.raises(CheckpointError) as error:  # without the conversion: one error line
    checkpoint.restore_state(workdir_lib.rolling_manager(old_dir, 2), prepared_program(config)[0].abstract_state,
                             step=3)
  assert "\n" not in str(error.value)
  config.num_train_steps = 6
  trainer.train_and_evaluate(config, old_dir)  # resumes at 3, converting
  assert "older release's layout" in caplog.text
  resumed = flat_state(final_state(config, old_dir))
  straight = flat_state(final_state(config, straight_dir))
  assert sorted(resumed) == sorted(straight) and any(".mu" in k for k in resumed)
  for k in straight:
    np.testing.assert_array_equal(resumed[k], straight[k], err_msg=k)
