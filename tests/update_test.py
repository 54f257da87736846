"""The fused update (`training/update.py`) against an independent NumPy AdamW + global-norm clipping +
EMA (the module docstring's equations, float64), bit for bit against optax's own per-leaf chain,
the keep-or-stop mask (a stopped member's state unchanged bit for bit, also under `vmap`), and the
checkpoint layouts (the previous release's flat optimizer state converts both ways; the older per-leaf
state is this state)."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from micse_jax.training import legacy_checkpoints, optim, update, weight_copies
from micse_jax.training.momentum import ema_update

B1, B2, EPS, WD, CLIP, DECAY = 0.9, 0.999, 1e-8, 0.1, 1.0, 0.99
LR0, LR1, RAMP = 1e-2, 1e-3, 10
SCALES = (5.0, 0.05, 3.0, 0.05, 0.2, 4.0)  # gradient scales: steps 0, 2 and 5 are clipped (‖g‖ > 1)


def lr_numpy(count: int) -> float:
  """optax.linear_schedule(LR0, LR1, RAMP) written out: the rate of the update with `count` steps before."""
  return LR0 + (LR1 - LR0) * min(count, RAMP) / RAMP


def schedule():
  return optax.linear_schedule(LR0, LR1, RAMP)


def inner():
  return optax.adamw(schedule(), b1=B1, b2=B2, eps=EPS, weight_decay=WD)


def make_params(seed=0):
  """Several leaves per shape (the variadic norm and the merged fusions), biases, a LayerNorm, a head."""
  k = jax.random.split(jax.random.PRNGKey(seed), 8)
  dense = lambda a, b: {"kernel": jax.random.normal(k[a], (6, 4)), "bias": jax.random.normal(k[b], (4,))}
  return {"encoder": {"layer": {"query": dense(0, 1), "key": dense(2, 3), "LayerNorm": {"scale": jax.random.normal(k[4], (4,))}},
                      "embeddings": {"embedding": jax.random.normal(k[5], (9, 6))}},
          "head": {"dense": {"kernel": jax.random.normal(k[6], (4, 4))}}}


def make_grads(params, step, scale):
  key = jax.random.fold_in(jax.random.PRNGKey(99), step)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return tree.unflatten([jax.random.normal(kk, x.shape) * scale / np.sqrt(x.size) for kk, x in zip(keys, leaves)])


def initial(params):
  tx = optax.chain(optax.clip_by_global_norm(CLIP), inner())
  ema = jax.tree.map(lambda x: x * 0.5, params["encoder"])
  return tx.init(params), ema, weight_copies.of(params, ema, jnp.bfloat16)


@jax.jit
def fused(grads, opt_state, params, ema, copies, keep=True):
  return update.apply(update.Inputs(inner=inner(), grads=grads, params=params, opt_state=opt_state, max_norm=CLIP,
                                    ema_params=ema, ema_decay=DECAY, copies=copies, keep=keep, skip_nonfinite=True))


def numpy_step(state, grads, keep):
  """One step of the module docstring's equations in float64 NumPy (leaves as flat lists)."""
  p, m, v, e, t = state
  g = [np.asarray(x, np.float64) for x in grads]
  norm = np.sqrt(sum(np.sum(x * x) for x in g))
  if not keep:
    return state, norm
  g = g if norm < CLIP else [x / norm * CLIP for x in g]
  lr, t = lr_numpy(t), t + 1
  m = [B1 * a + (1 - B1) * x for a, x in zip(m, g)]
  v = [B2 * a + (1 - B2) * x * x for a, x in zip(v, g)]
  p = [a - lr * ((mm / (1 - B1 ** t)) / (np.sqrt(vv / (1 - B2 ** t)) + EPS) + WD * a) for a, mm, vv in zip(p, m, v)]
  e = {i: DECAY * old + (1 - DECAY) * p[i] for i, old in e.items()}
  return (p, m, v, e, t), norm


def adam_state(opt_state):
  return opt_state[1][0]  # chain(clip, adamw): (clip's empty state, (ScaleByAdamState, ...))


def test_fused_update_equals_numpy_adamw_with_clipping_decay_ema_and_a_stopped_step():
  params = make_params()
  opt_state, ema, copies = initial(params)
  leaves, tree = jax.tree.flatten(params)
  encoder_index = {i: j for j, i in enumerate(range(len(jax.tree.leaves(params["encoder"]))))}
  as64 = lambda xs: [np.asarray(x, np.float64) for x in xs]
  ref = (as64(leaves), [np.zeros(x.shape) for x in leaves], [np.zeros(x.shape) for x in leaves],
         dict(zip(encoder_index, as64(jax.tree.leaves(ema)))), 0)
  keeps = (True, True, True, False, True, True)  # step 3: a stopped member's step
  clipped = 0
  for step, (scale, keep) in enumerate(zip(SCALES, keeps)):
    grads = make_grads(params, step, scale)
    before = (params, opt_state, ema, copies)
    r = fused(grads, opt_state, params, ema, copies, jnp.asarray(keep))
    ref, norm = numpy_step(ref, jax.tree.leaves(grads), keep)
    clipped += keep and norm > CLIP
    np.testing.assert_allclose(float(r.grad_norm), norm, rtol=1e-6)
    assert bool(r.applied) == keep
    if not keep:  # everything as it was, bit for bit
      jax.tree.map(np.testing.assert_array_equal, (r.params, r.opt_state, r.ema_params, r.copies), before)
    params, opt_state, ema, copies = r.params, r.opt_state, r.ema_params, r.copies
    p, m, v, e, t = ref
    for name, ours, theirs in (("params", jax.tree.leaves(params), p), ("mu", jax.tree.leaves(adam_state(opt_state).mu), m),
                               ("nu", jax.tree.leaves(adam_state(opt_state).nu), v), ("ema", jax.tree.leaves(ema), list(e.values()))):
      for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=2e-5, atol=1e-7, err_msg=f"{name} at step {step}")
    assert int(adam_state(opt_state).count) == t
  assert clipped == 3
  # the copies are the new weights cast, bit for bit
  np.testing.assert_array_equal(np.asarray(copies["encoder"]["layer"]["query"]["kernel"]),
                                np.asarray(params["encoder"]["layer"]["query"]["kernel"]).astype(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(copies["ema"]["layer"]["key"]["kernel"]),
                                np.asarray(ema["layer"]["key"]["kernel"]).astype(jnp.bfloat16))
  assert copies["encoder"]["layer"]["query"]["bias"] is None


def test_fused_update_is_optax_bit_for_bit():
  """The same formulas in the same order as optax's chain(clip_by_global_norm, adamw) → apply_updates,
  then `momentum.ema_update` and `weight_copies.of`: equal bit for bit (clipped steps included)."""
  @jax.jit
  def reference(grads, opt_state, params, ema):
    updates, opt_state = optax.chain(optax.clip_by_global_norm(CLIP), inner()).update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    ema = ema_update(params["encoder"], ema, DECAY)
    return params, opt_state, ema, weight_copies.of(params, ema, jnp.bfloat16), optax.tree.norm(grads)

  params = make_params(1)
  opt_state, ema, copies = initial(params)
  ours = theirs = (params, opt_state, ema, copies)
  for step, scale in enumerate(SCALES):
    grads = make_grads(params, step, scale)
    r = fused(grads, ours[1], ours[0], ours[2], ours[3])
    ref = reference(grads, theirs[1], theirs[0], theirs[2])
    ours, theirs = (r.params, r.opt_state, r.ema_params, r.copies), ref[:4]
    assert float(r.grad_norm) == float(ref[4])
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)


def test_a_non_finite_gradient_is_skipped_only_when_asked():
  params = make_params()
  opt_state, ema, copies = initial(params)
  grads = make_grads(params, 0, 1.0)
  grads["encoder"]["layer"]["key"]["bias"] = grads["encoder"]["layer"]["key"]["bias"].at[1].set(jnp.nan)
  r = fused(grads, opt_state, params, ema, copies)
  assert not bool(r.applied) and not np.isfinite(float(r.grad_norm))
  jax.tree.map(np.testing.assert_array_equal, (r.params, r.opt_state, r.ema_params, r.copies),
               (params, opt_state, ema, copies))
  # a solo run: the NaN goes through
  solo = update.apply(update.Inputs(inner=inner(), grads=grads, params=params, opt_state=opt_state, max_norm=CLIP))
  assert bool(solo.applied) and not np.all(np.isfinite(solo.params["encoder"]["layer"]["key"]["bias"]))


def test_members_under_vmap_stop_alone():
  """Three members stacked: one stopped, one with a non-finite gradient, one training as it would alone."""
  members = [make_params(s) for s in range(3)]
  states = [initial(p) for p in members]
  grads = [make_grads(p, 0, 2.0) for p in members]
  grads[2]["head"]["dense"]["kernel"] = grads[2]["head"]["dense"]["kernel"].at[0, 0].set(jnp.inf)
  stack = lambda trees: jax.tree.map(lambda *x: jnp.stack(x), *trees)
  args = (stack(grads), stack([s[0] for s in states]), stack(members), stack([s[1] for s in states]),
          stack([s[2] for s in states]), jnp.asarray([True, False, True]))
  r = jax.jit(jax.vmap(fused.__wrapped__))(*args)
  np.testing.assert_array_equal(np.asarray(r.applied), [True, False, False])
  member = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
  for i in (1, 2):
    jax.tree.map(np.testing.assert_array_equal, member((r.params, r.opt_state, r.ema_params, r.copies), i),
                 (members[i], *states[i]))
  alone = fused(grads[0], states[0][0], members[0], states[0][1], states[0][2])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-6, atol=1e-9),
               member((r.params, r.opt_state, r.ema_params, r.copies), 0),
               (alone.params, alone.opt_state, alone.ema_params, alone.copies))


def test_global_norm_is_optax_norm_bit_for_bit():
  grads = make_grads(make_params(), 3, 7.0)
  assert float(jax.jit(update.global_norm)(grads)) == float(jax.jit(optax.tree.norm)(grads))
  np.testing.assert_allclose(float(update.global_norm(grads)),
                             np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(grads))),
                             rtol=1e-6)


# ---------------------------------------------------------------- layouts


def _config(clip=CLIP):
  return ml_collections.ConfigDict({"optim": {"b1": B1, "b2": B2, "eps": EPS, "weight_decay": WD,
                                              "grad_clip_norm": clip, "learning_rate": LR0, "warmup_steps": 2},
                                    "num_train_steps": 10})


@pytest.mark.parametrize("clip", [CLIP, 0.0])
def test_the_state_is_the_per_leaf_optax_chain(clip):
  """`optim.make_optimizer`'s state is optax's own chain's (older per-leaf checkpoints hold it), and
  the step's `adamw` and `clip_norm` are that chain's parts."""
  config, params = _config(clip), make_params()
  schedule = optim.learning_rate_schedule(config)
  ours = jax.eval_shape(optim.make_optimizer(config).init, params)
  adamw = optax.adamw(schedule, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
  theirs = jax.eval_shape((optax.chain(optax.clip_by_global_norm(clip), adamw) if clip else adamw).init, params)
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  assert jax.tree.map(lambda s: (s.shape, s.dtype), ours) == jax.tree.map(lambda s: (s.shape, s.dtype), theirs)
  assert optim.clip_norm(config) == (clip or None)
  assert jax.tree.structure(jax.eval_shape(optim.adamw(config, schedule).init, params)) == \
      jax.tree.structure(jax.eval_shape(adamw.init, params))


def _flat_by_hand(per_leaf_state, params):
  """The previous release's flat layout written independently: each moment tree's leaves raveled in
  tree order into one float32 NumPy vector, zero-padded to a multiple of 4096."""
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  pad = -(-n // 4096) * 4096
  flat = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(tree)]
                                     + [np.zeros(pad - n, np.float32)])
  clip_state, (adam, *rest) = per_leaf_state
  return legacy_checkpoints.FlatState((clip_state, (adam._replace(mu=flat(adam.mu), nu=flat(adam.nu)), *rest)))


def test_the_previous_flat_layout_converts_both_ways_bit_for_bit():
  """A per-leaf state after 4 clipped steps, laid out flat by hand: `from_flat` gives it back bit
  for bit (counts kept, padding dropped), and `to_flat` writes the hand-made layout."""
  params = make_params()
  chain = optax.chain(optax.clip_by_global_norm(CLIP), inner())
  state, p = chain.init(params), params
  for step in range(4):
    updates, state = chain.update(make_grads(params, step, SCALES[step]), state, p)
    p = optax.apply_updates(p, updates)
  flat = _flat_by_hand(state, params)
  assert flat.inner_state[1][0].mu.shape == (4096,)
  converted = legacy_checkpoints.from_flat(flat, params)
  assert jax.tree.structure(converted) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, converted, state)
  jax.tree.map(np.testing.assert_array_equal, legacy_checkpoints.to_flat(state), flat)


def test_flat_state_converts_abstractly_at_bert_base_size():
  """The conversion on shapes alone (as a restore plans it), BERT-base's leaves, nothing materialised."""
  shapes = {f"layer_{i}": {"q": {"kernel": (768, 768), "bias": (768,)}, "ffn": {"kernel": (768, 3072), "bias": (3072,)},
                           "LayerNorm": {"scale": (768,), "bias": (768,)}} for i in range(12)}
  shapes["word_embeddings"] = {"embedding": (30522, 768)}
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=lambda s: isinstance(s, tuple))
  chain = optax.chain(optax.clip_by_global_norm(CLIP), inner())
  expected = jax.eval_shape(chain.init, params)
  flat_state = jax.eval_shape(legacy_checkpoints.to_flat, expected)
  n = sum(int(np.prod(s)) for s in jax.tree.leaves(shapes, is_leaf=lambda s: isinstance(s, tuple)))
  assert flat_state.inner_state[1][0].nu.shape == (-(-n // 4096) * 4096,)
  converted = jax.eval_shape(lambda s: legacy_checkpoints.from_flat(s, params), flat_state)
  assert jax.tree.structure(converted) == jax.tree.structure(expected)
  assert jax.tree.map(lambda s: s.shape, converted) == jax.tree.map(lambda s: s.shape, expected)


@pytest.mark.slow  # needs the extra 'aot' (jax-cuda13 plugin); ~20 s of deviceless compiles
def test_h100_update_is_few_kernels_not_one_per_leaf():
  """24 layers' worth of same-shaped kernels, biases and LayerNorms (120 leaves): XLA merges the
  leaves of a shape into a few fusions and the norm into one variadic reduction per shape, where the
  per-leaf optax chain launches one update and one or two reductions per leaf."""
  pytest.importorskip("jax_cuda13_plugin", reason="needs the extra 'aot' (pip install 'micse-jax[aot]')")
  from micse_jax.aot import hlo, hlo_module, topology
  jax.config.update("jax_platforms", "cpu")
  sharding = jax.sharding.SingleDeviceSharding(topology.target_devices("h100", 1)[0])
  shapes = {f"layer_{i}": {"dense": {"kernel": (256, 256), "bias": (256,)}, "LayerNorm": {"scale": (256,)},
                           "ffn": {"kernel": (256, 1024), "bias": (1024,)}} for i in range(24)}
  params = {"encoder": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding), shapes,
                                    is_leaf=lambda s: isinstance(s, tuple))}
  chain = optax.chain(optax.clip_by_global_norm(CLIP), inner())
  opt_state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                           jax.eval_shape(chain.init, params))

  def ours(grads, opt_state, params):
    r = update.apply(update.Inputs(inner=inner(), grads=grads, params=params, opt_state=opt_state, max_norm=CLIP,
                                  keep=True))
    return r.opt_state, r.params, r.grad_norm  # the donated arguments' order: each output updates its input in place

  def per_leaf(grads, opt_state, params):
    updates, opt_state = chain.update(grads, opt_state, params)
    return opt_state, optax.apply_updates(params, updates), optax.tree.norm(grads)

  compiled = lambda fn: jax.jit(fn, donate_argnums=(1, 2)).lower(params, opt_state, params).compile()
  count = lambda fn: len(hlo.kernels(hlo_module.parse(compiled(fn).as_text())))
  leaves, ours_kernels = len(jax.tree.leaves(params)), count(ours)
  assert ours_kernels <= 30 < leaves <= count(per_leaf), ours_kernels
  assert ours_kernels < leaves / 4


def test_a_member_learning_rate_scales_the_update_bit_for_bit():
  """`scale` (a member's peak learning rate on a schedule peaking at 1) multiplies optax's updates
  before they are applied, as the step did before the fused pass."""
  params = make_params(2)
  opt_state, _, _ = initial(params)
  grads, scale = make_grads(params, 0, 5.0), jnp.float32(0.37)
  ours = jax.jit(lambda g, s, p: update.apply(update.Inputs(inner=inner(), grads=g, params=p, opt_state=s, max_norm=CLIP,
                                                            scale=scale)))(grads, opt_state, params)

  @jax.jit
  def reference(g, s, p):
    updates, s = optax.chain(optax.clip_by_global_norm(CLIP), inner()).update(g, s, p)
    return optax.apply_updates(p, jax.tree.map(lambda u: u * scale, updates)), s
  theirs = reference(grads, opt_state, params)
  jax.tree.map(np.testing.assert_array_equal, (ours.params, ours.opt_state), theirs)
  assert not np.array_equal(ours.params["head"]["dense"]["kernel"],
                            fused(grads, opt_state, params, None, {}).params["head"]["dense"]["kernel"])


@pytest.mark.parametrize("max_norm", [CLIP, None])
def test_the_update_passes_the_optimizers_own_state_layout(max_norm):
  """What `apply` runs on the optimizer state (`update.transformation`) takes and returns the state
  `optim.make_optimizer`'s chain initialises (the checkpointed layout), clipping or not."""
  params = make_params()
  config = ml_collections.ConfigDict({"num_train_steps": 10, "optim": {
      "learning_rate": LR0, "warmup_steps": 2, "b1": B1, "b2": B2, "eps": EPS, "weight_decay": WD,
      "grad_clip_norm": max_norm or 0.0}})
  saved = optim.make_optimizer(config).init(params)
  ran = update.transformation(optim.adamw(config, optim.learning_rate_schedule(config)), max_norm)
  assert jax.tree.structure(ran.init(params)) == jax.tree.structure(saved)
  _, new_state = ran.update(make_grads(params, 0, 1.0), saved, params)
  assert jax.tree.structure(new_state) == jax.tree.structure(saved)
