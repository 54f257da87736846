"""The PyTorch peers of the bench: `compiled` (torch.compile, SDPA outside AMI's layers, fused
AdamW, `_foreach` EMA) computes the same step as `eager` (the public code's way)."""
import numpy as np
import pytest

from micse_jax.bench import jax_step

torch = pytest.importorskip("torch")


def _six_layer_bert(directory) -> str:
  """A random 6-layer BERT (hidden 64): two layers AMI does not read, so the compiled peer's SDPA runs."""
  import transformers
  torch.manual_seed(0)
  config = transformers.BertConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128)
  transformers.BertModel(config).save_pretrained(str(directory))
  return str(directory)


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
