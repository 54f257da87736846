"""The PyTorch peers of the bench compute the micse_jax step's loss (the headline ratios rest on
it): on the same weights, batch and queue with dropout off the eager peer's loss, InfoNCE and AMI
equal the JAX step's, and its AMI estimator equals `losses/ami.py`'s on two different views;
`compiled` (torch.compile, SDPA outside AMI's layers, fused AdamW, `_foreach` EMA) computes the
same step as `eager` (the public code's way)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.bench import jax_step

torch = pytest.importorskip("torch")


def _six_layer_bert(directory, dropout: float = 0.1) -> str:
  """A random 6-layer BERT (hidden 64): two layers AMI does not read, so the compiled peer's SDPA runs."""
  import transformers
  torch.manual_seed(0)
  config = transformers.BertConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128,
                                   hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
  transformers.BertModel(config).save_pretrained(str(directory))
  return str(directory)


def _hard_queue(peer, rng) -> np.ndarray:
  """`[QUEUE_SIZE, D]` unit keys near the batch's own embeddings (the peer's forward, head
  included), so that the queue weighs in the InfoNCE denominator as a trained queue does."""
  with torch.no_grad():
    z = peer.mlp(peer.model(**peer.batch).last_hidden_state[:, 0]).numpy()
  z /= np.linalg.norm(z, axis=1, keepdims=True)
  keys = z[rng.integers(0, len(z), peer.queue.shape[0])] + 0.3 * rng.normal(size=peer.queue.shape) / np.sqrt(z.shape[1])
  return (keys / np.linalg.norm(keys, axis=1, keepdims=True)).astype(np.float32)


def test_peer_loss_and_terms_equal_the_jax_step_with_dropout_off(tmp_path):
  """Same BERT weights (one checkpoint, dropout 0 in its config, read by both), the JAX step's
  MLP head copied into the peer, the same batch and the same full queue (ids no anchor has):
  the first step's loss, InfoNCE and mean AMI agree to float32 rounding. With dropout off the
  two views are equal, so every slice's rho is 1 and both clamp the MI at -1/2 log(1e-4)."""
  from micse_jax.bench.torch_step import AMI_WEIGHT, QUEUE_SIZE, TEMPERATURE, TorchMicseStep
  from micse_jax.training.momentum import Queue
  model_dir = _six_layer_bert(tmp_path / "bert6", dropout=0.0)
  batch = jax_step.random_batch(4, 16, 30522, seed=6)
  step = jax_step.JaxStep(model_dir, batch, "float32")
  c = step.config
  assert (c.ami.weight, c.loss.temperature, c.momentum.queue_size) == (AMI_WEIGHT, TEMPERATURE, QUEUE_SIZE)
  head = jax.device_get(step.state.params["head"]["dense"])
  peer = TorchMicseStep(model_dir, batch, "float32", "eager", device="cpu")
  with torch.no_grad():
    peer.mlp[0].weight.copy_(torch.from_numpy(np.array(head["kernel"]).T))
    peer.mlp[0].bias.copy_(torch.from_numpy(np.array(head["bias"])))
    queue = _hard_queue(peer, np.random.default_rng(0))
    peer.queue.copy_(torch.from_numpy(queue))
    terms = {k: float(v) for k, v in peer.terms(peer.batch, peer.queue).items()}
    loss = float(peer.loss(peer.batch, peer.queue))
  full = Queue(embeddings=jnp.asarray(queue), valid=jnp.ones(QUEUE_SIZE, bool),
               ids=jnp.arange(1000, 1000 + QUEUE_SIZE, dtype=jnp.int32), ptr=jnp.zeros((), jnp.int32))
  step.state = step.state.replace(queue=jax.device_put(full, jax.tree.map(lambda a: a.sharding, step.state.queue)))
  step.compile()
  metrics = jax.device_get(step.run_step())  # the loss of the state before the update
  assert metrics["ami_pairs"] == 1.0  # every (sentence, slice) pair counted, as in the peer's mean
  assert terms["ami_mi"] == pytest.approx(-0.5 * np.log(1e-4), rel=1e-4)  # 1 - 1e-4 rounded to float32
  assert terms["ami_mi"] == pytest.approx(float(metrics["ami_mi"]), rel=1e-5)
  assert terms["infonce"] > 1.0  # the queue weighs in: not a loss near 0
  assert terms["infonce"] == pytest.approx(float(metrics["infonce"]), rel=1e-5)
  assert loss == pytest.approx(float(metrics["loss"]), rel=1e-5)


def test_peer_ami_estimator_equals_the_jax_ami_on_different_views():
  """Two different attention maps per sentence with at most 128 valid cells per slice (lengths
  4-8 of 9 tokens, adjacent head pairs): m = 150 samples take every valid cell whatever the
  random draw, so the peer's AMI and `losses/ami.ami_loss`'s are the same function of the maps."""
  from micse_jax.bench.torch_step import _torch_ami
  from micse_jax.losses.ami import ami_loss
  rng = np.random.default_rng(7)
  n, layers, heads, t = 5, 4, 4, 9
  mask = (np.arange(t)[None] < rng.integers(4, t, n)[:, None]).astype(np.int64)
  logits = rng.normal(size=(layers, n, heads, t, t)) * 2
  logits = np.concatenate([logits, logits + rng.normal(size=logits.shape)], axis=1)  # view 2: view 1 disturbed
  logits = np.where(np.concatenate([mask, mask])[None, :, None, None, :] > 0, logits, -np.inf)
  att = np.exp(logits - logits.max(-1, keepdims=True))
  att = (att / att.sum(-1, keepdims=True)).astype(np.float32)
  _, metrics = ami_loss(jnp.asarray(att[:, :n]), jnp.asarray(att[:, n:]), jnp.asarray(mask), jax.random.PRNGKey(0),
                        weight=1.0, num_samples=150, heads_per_slice=2)
  ours = float(_torch_ami(torch, torch.from_numpy(att), torch.from_numpy(mask), n))
  assert float(metrics["ami_pairs"]) == 1.0 and 0.01 < ours < 4
  assert ours == pytest.approx(float(metrics["ami_mi"]), rel=1e-5)


def _pair(batch, model_dir=None):
  from micse_jax.bench.torch_step import TorchMicseStep
  model_dir = model_dir or jax_step.model_dir_for("tiny")
  steps = {}
  for mode in ("eager", "compiled"):
    torch.manual_seed(0)  # the same MLP head and initial queue for both
    steps[mode] = TorchMicseStep(model_dir, batch, "float32", mode, device="cpu")
  return steps


@pytest.mark.slow  # 20 s of the default run (torch.compile on CPU; CI budget)
def test_compiled_peer_computes_the_eager_loss_and_attention_where_ami_reads_it(monkeypatch, tmp_path):
  import torch._inductor.config as inductor_config
  monkeypatch.setattr(inductor_config, "fallback_random", True)  # inductor draws PyTorch's eager random numbers
  batch = jax_step.random_batch(4, 16, 30522, seed=3)
  steps = _pair(batch, _six_layer_bert(tmp_path / "bert6"))
  kinds = [layer.attention.self.config._attn_implementation for layer in steps["compiled"].model.encoder.layer]
  assert kinds == ["sdpa", "sdpa", "eager", "eager", "eager", "eager"]
  sdpa_calls = []
  real_sdpa = torch.nn.functional.scaled_dot_product_attention
  monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                      lambda *a, **k: (sdpa_calls.append(1), real_sdpa(*a, **k))[1])
  with torch.no_grad():  # eagerly: the two first layers run PyTorch's SDPA, the last four return probabilities
    out = steps["compiled"].model(**steps["compiled"].batch, output_attentions=True)
  assert len(sdpa_calls) == 2 and len([a for a in out.attentions if a is not None]) == 4
  losses = {}
  for mode, step in steps.items():
    step.model.eval()  # dropout off: both see the same network
    torch.manual_seed(1)  # the same AMI samples
    losses[mode] = float(step.loss_fn(step.batch, step.queue).detach())
  assert np.isfinite(losses["eager"])
  assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-5)


def test_foreach_ema_is_the_loop_ema():
  batch = jax_step.random_batch(2, 8, 30522, seed=4)
  steps = _pair(batch)
  for step in steps.values():
    with torch.no_grad():
      for i, p in enumerate(step.model.parameters()):
        p.add_(0.01 * (i + 1))  # online moves away from the momentum copy
  before = [p.detach().clone() for p in steps["eager"].momentum.parameters()]
  online = [p.detach().clone() for p in steps["eager"].model.parameters()]
  for step in steps.values():
    with torch.no_grad():
      step.ema()
  for mode, step in steps.items():
    for b, o, after in zip(before, online, step.momentum.parameters()):
      np.testing.assert_allclose(after.numpy(), (0.995 * b + 0.005 * o).numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_compiled_step_trains_and_fills_the_queue():
  batch = jax_step.random_batch(4, 16, 30522, seed=5)
  step = _pair(batch)["compiled"]
  first = [p.detach().clone() for p in step.model.parameters()]
  loss = step.step()
  assert np.isfinite(loss) and step.ptr == 4
  np.testing.assert_allclose(step.queue[:4].norm(dim=-1).numpy(), 1.0, rtol=1e-5)
  assert any(not torch.equal(a, b) for a, b in zip(first, step.model.parameters()))
