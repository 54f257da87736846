"""`SentenceEncoder.encode` equals the PyTorch computation of each pooler."""
import numpy as np
import pytest

from micse_jax import SentenceEncoder
from tests.helpers import shared_sentences


@pytest.fixture(scope="module")
def encoder(minilm_dir):
  return SentenceEncoder.from_pretrained(minilm_dir)


def _torch_pooled(model_dir, sentences, pooler, max_length):
  import torch
  import transformers
  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  model = transformers.AutoModel.from_pretrained(model_dir).eval()
  out = []
  for s in sentences:  # one at a time: no padding at all on the reference side
    inputs = tok([s], truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
      o = model(**inputs)
    if pooler == "avg":
      out.append(o.last_hidden_state[0].mean(0).numpy())
    elif pooler == "cls":
      out.append(o.pooler_output[0].numpy())
    else:
      out.append(o.last_hidden_state[0, 0].numpy())
  return np.stack(out)


@pytest.mark.parametrize("pooler", ["cls_before_pooler", "cls", "avg"])
def test_encode_matches_pytorch_pooling(encoder, minilm_dir, shared_data, pooler):
  sentences = shared_sentences(shared_data, 20) + ["Short.", "x " * 200]  # one truncated at 64
  ours = encoder.encode(sentences, pooler=pooler, batch_size=8, max_length=64)
  ref = _torch_pooled(minilm_dir, sentences, pooler, max_length=64)
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_encode_order_is_independent_of_batching(encoder):
  sentences = ["a b c d e f g h i j", "short", "a medium length sentence here", "tiny one"] * 3
  a = encoder.encode(sentences, batch_size=3)
  b = encoder.encode(sentences[::-1], batch_size=5)[::-1]
  np.testing.assert_allclose(a, b, atol=1e-5)
  assert encoder.encode([]).shape == (0, encoder.hidden_size)


def test_encode_rejects_bad_arguments(encoder):
  with pytest.raises(ValueError, match="unknown pooler"):
    encoder.encode(["x"], pooler="max")
  with pytest.raises(TypeError):
    encoder.encode("a single string")


def test_compile_plan_compiles_every_program_encode_plan_runs(minilm_dir):
  """A trainer compiles its dev evaluation before its first step: after `compile_plan`, encoding the
  plan compiles nothing more, and it compiled one program per distinct batch shape."""
  encoder = SentenceEncoder.from_pretrained(minilm_dir)  # its own programs (the encoder is a static argument)
  sentences = ["word " * n for n in (3, 4, 40, 45, 100)]  # three padded lengths at batch 2
  plan = encoder.plan(sentences, batch_size=2, max_length=128)
  shapes = {batch["input_ids"].shape for _, batch in plan.batches}
  before = SentenceEncoder._embed._cache_size()
  encoder.compile_plan(plan)
  assert len(shapes) == 3 and SentenceEncoder._embed._cache_size() == before + len(shapes)
  encoder.encode_plan(plan)
  assert SentenceEncoder._embed._cache_size() == before + len(shapes)
