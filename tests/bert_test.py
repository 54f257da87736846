"""The Flax BERT is numerically HF's PyTorch BertModel (eval), and dropout behaves as HF's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.models import collect_attentions, load_pretrained
from micse_jax.tokenization import Tokenizer
from tests.helpers import SENTENCES, shared_sentences, torch_forward, write_tiny_hf_checkpoint

TOL = 1e-4


def _max_abs(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _compare(model_dir, sentences, mlm=False):
  model, params, config, _ = load_pretrained(model_dir, add_mlm_head=mlm)
  layers = tuple(range(config.num_hidden_layers))
  model = model.clone(sow_attention_layers=layers)
  batch = Tokenizer.from_pretrained(model_dir)(sentences, max_length=64)
  out, state = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                           batch["token_type_ids"], output_hidden_states=True, mutable=["intermediates"])
  ref = torch_forward(model_dir, batch, mlm=mlm)
  attentions = collect_attentions(state["intermediates"], layers)
  for i in layers:
    assert _max_abs(attentions[i], ref.attentions[i].numpy()) <= TOL, f"attention layer {i}"
  if mlm:
    assert _max_abs(out.mlm_logits, ref.logits.numpy()) <= TOL
    assert _max_abs(out.last_hidden_state, ref.hidden_states[-1].numpy()) <= TOL
  else:
    assert _max_abs(out.last_hidden_state, ref.last_hidden_state.numpy()) <= TOL
    assert _max_abs(out.pooler_output, ref.pooler_output.numpy()) <= TOL
  for ours, theirs in zip(out.hidden_states, ref.hidden_states):
    assert _max_abs(ours, theirs.numpy()) <= TOL


def test_tiny_random_bert_with_mlm_head_matches_pytorch(tmp_path, minilm_dir, shared_data):
  path = write_tiny_hf_checkpoint(str(tmp_path / "tiny"), minilm_dir, mlm=True)
  _compare(path, shared_sentences(shared_data, 8), mlm=True)


def test_tiny_random_bert_model_matches_pytorch(tmp_path, minilm_dir):
  path = write_tiny_hf_checkpoint(str(tmp_path / "tiny"), minilm_dir, mlm=False, hidden_act="gelu")
  _compare(path, SENTENCES)


def test_tiny_random_roberta_matches_pytorch(tmp_path, minilm_dir):
  path = write_tiny_hf_checkpoint(str(tmp_path / "rob"), minilm_dir, model_type="roberta")
  _compare(path, SENTENCES)


def test_real_minilm_checkpoint_matches_pytorch(minilm_dir, shared_data):
  _compare(minilm_dir, shared_sentences(shared_data, 12))


def test_real_tiny_mlm_checkpoint_matches_pytorch(tiny_real_dir):
  _compare(tiny_real_dir, SENTENCES, mlm=True)


def test_dropout_views_differ_in_train_mode_and_eval_is_deterministic(tmp_path, minilm_dir):
  path = write_tiny_hf_checkpoint(str(tmp_path / "tiny"), minilm_dir, mlm=False)
  model, params, _, _ = load_pretrained(path, sow_attention_layers=(0, 1))
  batch = Tokenizer.from_pretrained(path)(SENTENCES[:2] * 2, max_length=32)  # two identical views
  apply = lambda det, key: model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                                       deterministic=det, rngs={"dropout": key}, mutable=["intermediates"])
  out, state = apply(False, jax.random.PRNGKey(0))
  h = np.asarray(out.last_hidden_state)
  assert _max_abs(h[:2], h[2:]) > 1e-3, "two views in one batch must get independent dropout masks"
  att = np.asarray(collect_attentions(state["intermediates"], (0,)))[0]
  # Attention dropout is per element: the zero patterns of the two views (and of heads) differ.
  assert not np.array_equal(att[:2] == 0, att[2:] == 0)
  assert not np.array_equal(att[:, 0] == 0, att[:, 1] == 0)
  # Inverted dropout: kept probabilities are scaled by 1/(1-p); zeros appear among real keys.
  assert (att[0, :, :, :len(batch["input_ids"][0])] == 0).any()
  e1, _ = apply(True, jax.random.PRNGKey(1))
  e2, _ = apply(True, jax.random.PRNGKey(2))
  np.testing.assert_array_equal(np.asarray(e1.last_hidden_state), np.asarray(e2.last_hidden_state))
  out2, _ = apply(False, jax.random.PRNGKey(1))
  assert _max_abs(out.last_hidden_state, out2.last_hidden_state) > 1e-3, "dropout depends on the key"


def test_only_requested_layers_are_sown(tmp_path, minilm_dir):
  path = write_tiny_hf_checkpoint(str(tmp_path / "tiny"), minilm_dir, mlm=False)
  model, params, _, _ = load_pretrained(path, sow_attention_layers=(1,))
  batch = Tokenizer.from_pretrained(path)(SENTENCES, max_length=32)
  _, state = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                         mutable=["intermediates"])
  assert set(state["intermediates"]["encoder"]) == {"layer_1"}
  with pytest.raises(ValueError, match="out of range"):
    model.clone(sow_attention_layers=(5,)).apply({"params": params}, batch["input_ids"], batch["attention_mask"])


def test_bf16_compute_is_close_to_fp32(minilm_dir):
  model, params, _, _ = load_pretrained(minilm_dir)
  batch = Tokenizer.from_pretrained(minilm_dir)(SENTENCES, max_length=32)
  f32 = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"]).last_hidden_state
  b16 = model.clone(dtype=jnp.bfloat16).apply({"params": params}, batch["input_ids"], batch["attention_mask"])
  assert b16.last_hidden_state.dtype == jnp.bfloat16
  cos = np.sum(np.asarray(f32[:, 0]) * np.asarray(b16.last_hidden_state[:, 0], np.float32), -1) / (
      np.linalg.norm(f32[:, 0], axis=-1) * np.linalg.norm(np.asarray(b16.last_hidden_state[:, 0], np.float32), axis=-1))
  assert cos.min() > 0.99


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_embedding_lookup_and_its_gradient_stay_float32(dtype):
  """Lookup = the float32 rows cast to the compute dtype; d table = float32 np.add.at of the
  output gradient; the gradient's scatter-add is float32 in the lowered program (a half-precision
  scatter-add into the table was 35 of a 55 ms step on an H100)."""
  from micse_jax.models.embed import Embed
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, 5, size=(3, 7)), jnp.int32)
  ids = ids.at[:, 0].set(0)                      # repeated rows: the accumulation is what's tested
  weight = jnp.asarray(rng.normal(size=(3, 7, 4)), jnp.float32)
  embed = Embed(num_embeddings=5, features=4, dtype=dtype)
  params = embed.init(jax.random.key(0), ids)
  table = np.asarray(params["params"]["embedding"])
  assert table.dtype == np.float32

  out = embed.apply(params, ids)
  assert out.dtype == dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(jnp.asarray(table[np.asarray(ids)]).astype(dtype), np.float32))

  def loss(p):
    return jnp.sum(embed.apply(p, ids).astype(jnp.float32) * weight)
  grad = jax.grad(loss)(params)["params"]["embedding"]
  expected = np.zeros_like(table)
  np.add.at(expected, np.asarray(ids), np.asarray(weight.astype(dtype).astype(jnp.float32)))
  np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-6)

  program = jax.jit(jax.grad(loss)).lower(params).as_text()
  scatters = [line for line in program.splitlines() if ") -> tensor<5x4x" in line]
  assert scatters and all("5x4xf32" in line for line in scatters), scatters


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gelu_is_x_times_the_normal_cdf_and_so_is_its_gradient(dtype):
  """`gelu_erf` against x·Φ(x) and Φ(x) + x·φ(x) in float64 (scipy) and against PyTorch's `F.gelu`.
  float32: the erf form's 1 + erf(x/√2) cancels to 0 below x ≈ −5.3, where |x·Φ(x)| < 1e-6 (PyTorch's
  kernel keeps that tail), hence the absolute bound. Half inputs: the float64 value rounded once to the
  dtype (one ulp), or that float32 tail."""
  import torch
  from scipy import special

  from micse_jax.models.bert_config import gelu_erf
  x = np.concatenate([np.linspace(-9, 9, 4001), [0.0, -1e-3, 1e-3, -30.0, 30.0]])
  x = np.asarray(jnp.asarray(x, dtype), np.float64)  # representable in the dtype
  cdf = 0.5 * (1 + special.erf(x / np.sqrt(2)))
  ours = np.asarray(gelu_erf(jnp.asarray(x, dtype)), np.float64)
  if dtype == jnp.float32:
    np.testing.assert_allclose(ours, x * cdf, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(ours, torch.nn.functional.gelu(torch.tensor(x, dtype=torch.float32)).numpy(),
                               rtol=2e-6, atol=1e-6)
    grad = jax.vmap(jax.grad(gelu_erf))(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(grad, cdf + x * np.exp(-x ** 2 / 2) / np.sqrt(2 * np.pi), rtol=2e-6, atol=1e-6)
  else:
    spacing = np.abs(np.asarray(jnp.asarray(x * cdf, dtype), np.float64)) * float(jnp.finfo(dtype).eps)
    assert np.all(np.abs(ours - x * cdf) <= np.maximum(spacing, 1e-6)), dtype
