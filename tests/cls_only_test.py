"""`BertModel(cls_only=True)`: the last layer computes the [CLS] row only past its attention.

Against the full model (the reference: every row computed), in train mode with dropout on every
site, the same parameters and keys: the [CLS] output, the pooler, the sown attention of every
query and the gradients of a loss on [CLS]; a dropout site given the full shape draws the full
draw's leading part for every generator; the training step's encoders use it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.models.bert import BertConfig, BertModel, collect_attentions
from micse_jax.models.dropout import RANDOM_BITS, RNG_IMPLS, Dropout
from micse_jax.models.policy import Policy


@pytest.mark.parametrize("bits", RANDOM_BITS)
@pytest.mark.parametrize("impl", tuple(RNG_IMPLS))
def test_a_site_given_the_full_shape_draws_the_full_draws_leading_part(impl, bits):
  x = jax.random.normal(jax.random.PRNGKey(1), (6, 9, 40))
  rngs = {"dropout": jax.random.PRNGKey(2)}
  full = Dropout(0.3, bits, impl).apply({}, x, deterministic=False, rngs=rngs)
  part = Dropout(0.3, bits, impl).apply({}, x[:, :1], deterministic=False, rngs=rngs, draw_shape=x.shape)
  np.testing.assert_array_equal(part, full[:, :1])
  own = Dropout(0.3, bits, impl).apply({}, x[:, :1], deterministic=False, rngs=rngs)
  assert not np.array_equal(own, part)  # the part's own-shape draw is another mask


def _config(attention_dropout: float) -> BertConfig:
  return BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.2,
                    attention_probs_dropout_prob=attention_dropout)


def _batch():
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(5, 50, size=(5, 11)), jnp.int32)
  mask = jnp.asarray(np.arange(11)[None, :] < np.array([11, 7, 4, 11, 9])[:, None], jnp.int32)
  return ids, mask


@pytest.mark.parametrize("attention_dropout, sown, attention, remat", [
    (0.1, (1, 2), "fused", "none"),    # the last layer's probabilities sown (AMI) and dropped: explicit path
    (0.0, (), "fused", "none"),        # nothing needs the probabilities: the fused attention kernel
    (0.1, (), "explicit", "none"),
    pytest.param(0.1, (2,), "fused", "full", marks=pytest.mark.slow),  # the last layer rematerialised
])
def test_cls_row_sown_attention_and_gradients_equal_the_full_models(attention_dropout, sown, attention, remat):
  config = _config(attention_dropout)
  ids, mask = _batch()
  full = BertModel(config, sow_attention_layers=sown, policy=Policy(attention))
  cls_only = BertModel(config, sow_attention_layers=sown, policy=Policy(attention, remat), cls_only=True)
  params = full.init(jax.random.PRNGKey(0), ids, mask)["params"]
  weights = jax.random.normal(jax.random.PRNGKey(3), (5, 32))
  rngs = {"dropout": jax.random.PRNGKey(4)}

  def run(model, params):
    out, state = model.apply({"params": params}, ids, mask, deterministic=False, rngs=rngs,
                             mutable=["intermediates"])
    return out, state

  (f, fs), (c, cs) = run(full, params), run(cls_only, params)
  assert c.last_hidden_state.shape == (5, 1, 32)
  np.testing.assert_allclose(c.last_hidden_state[:, 0], f.last_hidden_state[:, 0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(c.pooler_output, f.pooler_output, rtol=1e-5, atol=1e-6)
  assert not np.allclose(f.last_hidden_state[:, 0], f.last_hidden_state[:, 1])  # row 0 is not everything
  if sown:
    np.testing.assert_allclose(collect_attentions(cs["intermediates"], sown),
                               collect_attentions(fs["intermediates"], sown), rtol=1e-6, atol=1e-7)

  def loss(model):
    def fn(params):
      out, state = run(model, params)
      value = jnp.sum(weights * out.last_hidden_state[:, 0] ** 2)
      if sown:
        value += jnp.sum(collect_attentions(state["intermediates"], sown) ** 2)
      return value
    return fn

  got, want = jax.grad(loss(cls_only))(params), jax.grad(loss(full))(params)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6), got, want)


def test_the_training_encoders_compute_the_cls_row_only(tmp_path, minilm_dir):
  from micse_jax.models.loading import load_config
  from micse_jax.training.networks import build_networks
  from tests.train_utils import tiny_training_config
  config = tiny_training_config(tmp_path, minilm_dir)
  nets = build_networks(config, load_config(minilm_dir))
  assert nets.online.cls_only and nets.momentum.cls_only
