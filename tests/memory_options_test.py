"""Memory options that must not change the function computed: rematerialised BERT layers
(`model.remat`) give the step's gradients of the plain step, AMI's sown attention maps
included; the fused attention kernel (`model.attention=fused`) equals the explicit softmax path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.models.bert import BertConfig, BertModel, collect_attentions
from micse_jax.models.policy import Policy

GRAD_ATOL = 1e-6


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, minilm_dir):
  from tests.train_utils import prepared_program, tiny_training_config
  config = tiny_training_config(tmp_path_factory.mktemp("remat"), minilm_dir)
  prog, (run,) = prepared_program(config)
  return run, prog.initial_state([run])


def _loss_and_grads(run, state, remat: str):
  """The miCSE step's loss, metrics and gradients (dropout and AMI on) with `model.remat`."""
  from micse_jax.training import program
  from micse_jax.training.step import make_loss_fn, step_keys
  config = run.config.copy_and_resolve_references()
  config.model.remat = remat
  prog = program.build(config, run.bert_config, program.abstract_of(run.encoder_params), tokens=run.tokens)
  loss_fn = make_loss_fn(config, prog.nets)
  batch = {k: jnp.asarray(v) for k, v in run.batches.batch(0).items()}
  args = (state.frozen_params, batch, state.queue, step_keys(state.rng, state.step), state.step)
  fn = jax.value_and_grad(loss_fn, has_aux=True)
  (loss, metrics), grads = jax.jit(fn)(state.params, *args)
  return loss, metrics, grads, jax.make_jaxpr(fn)(state.params, *args)


def test_remat_layers_give_the_plain_gradients_and_ami_still_reads_the_maps(tiny_run):
  run, state = tiny_run
  loss, metrics, grads, jaxpr = _loss_and_grads(run, state, "none")
  assert "checkpoint" not in str(jaxpr) and "remat" not in str(jaxpr)
  assert abs(float(metrics["ami_mi"])) > 0  # the AMI term reads the sown maps
  for remat in ("layer", "full"):
    loss_r, metrics_r, grads_r, jaxpr_r = _loss_and_grads(run, state, remat)
    assert "checkpoint" in str(jaxpr_r) or "remat" in str(jaxpr_r)  # the layers really are remat'd
    np.testing.assert_allclose(float(loss_r), float(loss), rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(metrics_r["ami_mi"]), float(metrics["ami_mi"]), rtol=0, atol=1e-6)
    worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads, grads_r)))
    print(f"remat={remat}: max abs gradient difference {worst:.3g}")
    assert worst <= GRAD_ATOL, (remat, worst)
  # not vacuous: the gradients themselves are far above the tolerance
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 1e3 * GRAD_ATOL


def test_unknown_remat_or_attention_is_rejected():
  with pytest.raises(ValueError, match="remat"):
    Policy(remat="everything")
  with pytest.raises(ValueError, match="attention"):
    Policy(attention="flash")


# ---------------------------------------------------------------- fused attention

def _tiny_bert(attention_dropout=0.0, hidden_dropout=0.0):
  return BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=hidden_dropout,
                    attention_probs_dropout_prob=attention_dropout)


def _inputs():
  ids = jax.random.randint(jax.random.PRNGKey(0), (4, 12), 1, 97)
  mask = (jnp.arange(12)[None] < jnp.array([[12], [7], [3], [10]])).astype(jnp.int32)
  return ids * mask, mask


def _count_fused_calls(monkeypatch):
  calls = []
  real = jax.nn.dot_product_attention

  def counting(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)
  monkeypatch.setattr(jax.nn, "dot_product_attention", counting)
  return calls


def _forward_and_grads(config, attention, deterministic, params=None):
  """Hidden states, sown maps of layer 1 and parameter gradients of a fixed scalar function."""
  ids, mask = _inputs()
  model = BertModel(config, sow_attention_layers=(1,), policy=Policy(attention))
  params = params or model.init(jax.random.PRNGKey(1), ids, mask)["params"]

  def f(p):
    out, st = model.apply({"params": p}, ids, mask, deterministic=deterministic,
                          rngs={"dropout": jax.random.PRNGKey(2)}, mutable=["intermediates"])
    att = collect_attentions(st["intermediates"], (1,))
    real = mask[:, :, None]  # padded query positions do not enter the function
    return jnp.sum(jnp.sin(out.last_hidden_state) * real) + jnp.sum(att ** 2), (out.last_hidden_state, att)
  (_, (hidden, att)), grads = jax.value_and_grad(f, has_aux=True)(params)
  return params, hidden, att, grads


@pytest.mark.parametrize("deterministic, hidden_dropout", [(True, 0.0), (False, 0.1)])
def test_fused_attention_equals_the_explicit_path(monkeypatch, deterministic, hidden_dropout):
  """Layers 0 and 2 (not sown, no attention dropout) take the fused kernel; layer 1 is sown."""
  config = _tiny_bert(hidden_dropout=hidden_dropout)
  calls = _count_fused_calls(monkeypatch)
  params, h_explicit, att_explicit, g_explicit = _forward_and_grads(config, "explicit", deterministic)
  assert not calls
  _, h_fused, att_fused, g_fused = _forward_and_grads(config, "fused", deterministic, params)
  assert len(calls) == 2  # layers 0 and 2 only: the sown AMI layer keeps explicit probabilities
  real = np.asarray(_inputs()[1], bool)
  np.testing.assert_allclose(np.asarray(h_fused)[real], np.asarray(h_explicit)[real], rtol=0, atol=1e-5)
  np.testing.assert_allclose(att_fused, att_explicit, rtol=0, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_explicit)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_attention_dropout_keeps_the_explicit_path_in_training(monkeypatch):
  """A fused kernel cannot drop single probabilities: with attention dropout > 0 a training
  forward never takes it (an evaluation forward still does)."""
  config = _tiny_bert(attention_dropout=0.1, hidden_dropout=0.1)
  calls = _count_fused_calls(monkeypatch)
  params, h_explicit, _, _ = _forward_and_grads(config, "explicit", deterministic=False)
  _, h_fused, _, _ = _forward_and_grads(config, "fused", deterministic=False, params=params)
  assert not calls
  np.testing.assert_array_equal(np.asarray(h_fused), np.asarray(h_explicit))
  _forward_and_grads(config, "fused", deterministic=True, params=params)
  assert len(calls) == 2
