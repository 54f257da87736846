"""`model.rng_impl` (models/dropout.py): the dropout generator. Each generator's drop rate and
scaling, and that no two dropout draws share a mask: sites (layers, the two views' rows), steps,
devices (a batch-sharded mesh draws what one device draws) and population members (under `vmap`
each member draws from its own key: its masks are its solo run's, never another member's)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax import config_checks
from micse_jax.augmentation.dropout_views import interleave_views
from micse_jax.errors import ConfigError
from micse_jax.models.bert import BertConfig, BertModel, collect_attentions
from micse_jax.models.dropout import RNG_IMPLS, Dropout, drop_threshold, keep_mask
from micse_jax.training.step import step_keys
from tests.helpers import run_device_worker

IMPLS = tuple(RNG_IMPLS)
RATE = 0.3


def _binomial_ok(dropped: np.ndarray, p: float) -> bool:
  """The observed drop rate within 5 standard deviations of p."""
  return abs(dropped.mean() - p) < 5 * np.sqrt(p * (1 - p) / dropped.size)


def _agreement_is_independent(a: np.ndarray, b: np.ndarray, p: float) -> bool:
  """Two keep masks agree where both keep or both drop: p² + (1-p)² for independent masks."""
  expected = p * p + (1 - p) * (1 - p)
  return abs(np.mean(a == b) - expected) < 5 * np.sqrt(expected * (1 - expected) / a.size)


@pytest.mark.parametrize("bits", [32, 16])
@pytest.mark.parametrize("impl", IMPLS)
def test_drop_rate_and_scaling(impl, bits):
  y = np.asarray(Dropout(RATE, bits, impl).apply({}, jnp.ones((400, 1001)), deterministic=False,
                                                 rngs={"dropout": jax.random.PRNGKey(0)}))
  assert set(np.unique(y)) == {0.0, np.float32(1 / (1 - RATE))}
  assert _binomial_ok(y == 0, drop_threshold(RATE, bits) / 2 ** bits)
  assert abs(drop_threshold(RATE, bits) / 2 ** bits - RATE) <= 2.0 ** -(bits + 1)


def test_a_bad_generator_is_one_clear_error():
  with pytest.raises(ValueError, match="rng_impl"):
    Dropout(RATE, 32, "mersenne").apply({}, jnp.ones(4), deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
  from micse_jax.configs import default
  config = default.get_config()
  config.model.rng_impl = "mersenne"
  with pytest.raises(ConfigError, match="model.rng_impl"):
    config_checks.check_config(config)


@pytest.mark.parametrize("impl", IMPLS)
def test_layers_and_the_two_views_rows_draw_independent_masks(impl):
  """A train-mode forward of interleaved views with every layer's attention probabilities sown
  (dropped probabilities are exactly 0; no padding, so no other zeros)."""
  config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.5, max_position_embeddings=32,
                      dropout_rng_impl=impl)
  model = BertModel(config, sow_attention_layers=(0, 1, 2))
  ids = jax.random.randint(jax.random.PRNGKey(1), (16, 24), 1, 64)
  both = interleave_views({"ids": ids}, {"ids": ids})["ids"]
  params = model.init(jax.random.PRNGKey(0), both, jnp.ones_like(both))
  _, state = model.apply(params, both, jnp.ones_like(both), deterministic=False,
                         rngs={"dropout": jax.random.PRNGKey(2)}, mutable=["intermediates"])
  keep = np.asarray(collect_attentions(state["intermediates"], (0, 1, 2))) > 0  # [layers, 2B, heads, T, T]
  assert _binomial_ok(~keep, 0.5)
  assert _agreement_is_independent(keep[0], keep[1], 0.5) and _agreement_is_independent(keep[1], keep[2], 0.5)
  assert _agreement_is_independent(keep[:, 0::2], keep[:, 1::2], 0.5)  # view 1 rows against view 2 rows


@pytest.mark.parametrize("impl", IMPLS)
def test_steps_draw_independent_masks(impl):
  """The step's dropout key (`step_keys`: the state's key folded with the step) at steps 0 and 1."""
  rng = jax.random.PRNGKey(7)
  first, second = (np.asarray(keep_mask(step_keys(rng, s)["drop"], (64, 512), RATE, 32, impl)) for s in (0, 1))
  assert _agreement_is_independent(first, second, 1 - RATE)


@pytest.mark.parametrize("bits", [32, 16])
@pytest.mark.parametrize("impl", IMPLS)
def test_vmapped_members_draw_their_own_masks(impl, bits):
  """Under `vmap` over the members' keys each member's mask is the one its own key draws alone,
  and members' masks are independent (XLA's RngBitGenerator, batched by JAX, would draw every
  member's bits from the first member's key)."""
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  draw = lambda key: keep_mask(key, (6, 300), RATE, bits, impl)
  batched = np.asarray(jax.jit(jax.vmap(draw))(keys))
  np.testing.assert_array_equal(batched, np.stack([np.asarray(draw(k)) for k in keys]))
  assert _agreement_is_independent(batched[0], batched[1], 1 - RATE)
  swapped = np.asarray(jax.jit(jax.vmap(draw))(keys[::-1]))  # a member's mask does not depend on its place
  np.testing.assert_array_equal(swapped[::-1], batched)


def test_the_state_key_is_the_same_whatever_the_generator(tmp_path, minilm_dir):
  """Checkpoints resume across `model.rng_impl`: the train state (its key included) has one layout."""
  from tests.train_utils import step0_shapes, tiny_training_config
  shapes = []
  for impl in IMPLS:
    shapes.append(step0_shapes(tiny_training_config(tmp_path, minilm_dir, **{"model.rng_impl": impl})))
  assert all(jax.tree.structure(s) == jax.tree.structure(shapes[0]) for s in shapes)
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: a.shape == b.shape and a.dtype == b.dtype, s, shapes[0]))
             for s in shapes)


def test_four_devices_draw_what_one_device_draws():
  """A batch-sharded dropout on 4 devices equals the 1-device draw (tests/dropout_devices_worker.py),
  and the four devices' row blocks are independent masks."""
  result = run_device_worker("tests.dropout_devices_worker", devices=4, timeout=300)
  for impl in IMPLS:
    assert result[impl]["max_diff"] == 0.0, result
    assert result[impl]["block_agreement_ok"], result
