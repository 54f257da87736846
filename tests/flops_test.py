"""MFU's numerator (`training/flops.py`) against XLA's FLOP count on CPU, which does see every
matrix product (on a GPU it misses those inside cuBLAS calls), and a hand-computed step."""
import jax
import jax.numpy as jnp
import pytest

from micse_jax.models.bert import BertConfig, BertModel
from micse_jax.training import flops

BATCH, TOKENS = 4, 32
CONFIG = BertConfig(vocab_size=64, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=1024, max_position_embeddings=TOKENS)


def _xla_flops(fn, *args) -> float:
  return float(flops.xla_flops(jax.jit(fn).lower(*args).compile()))


def _encoder():
  model = BertModel(CONFIG)
  ids = jnp.ones((BATCH, TOKENS), jnp.int32)
  mask = jnp.ones((BATCH, TOKENS), jnp.int32)
  params = model.init(jax.random.key(0), ids, mask)["params"]
  def forward(p):
    return model.apply({"params": p}, ids, mask).pooler_output
  return forward, params


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="XLA's count is complete on CPU only")
def test_encoder_forward_is_xla_count_less_the_elementwise_work():
  forward, params = _encoder()
  model_count = BATCH * flops.encoder_forward_flops(TOKENS, 2, 256, 1024)
  xla = _xla_flops(forward, params)
  # XLA adds layer norms, GELU, softmax, biases: a few % at this width, never less than the products.
  assert model_count <= xla <= 1.08 * model_count, (xla, model_count)


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="XLA's count is complete on CPU only")
def test_forward_and_backward_is_three_forwards():
  forward, params = _encoder()
  model_count = 3 * BATCH * flops.encoder_forward_flops(TOKENS, 2, 256, 1024)
  xla = _xla_flops(jax.grad(lambda p: jnp.sum(forward(p))), params)
  # The backward skips the input-gradient of the first products (the embeddings need none).
  assert 0.9 * model_count <= xla <= 1.1 * model_count, (xla, model_count)


def test_train_step_by_hand():
  # B=2, T=3, one layer, H=4, I=8, Q=5. Layer: 8·3·16 + 4·3·4·8 + 4·9·4 = 384 + 384 + 144 = 912;
  # with the head (2·16) 944 per sequence. Online 2 views fwd+bwd: 3·2·2·944 = 11,328;
  # momentum forward: 2·944 = 1,888; similarity: 2 anchors × (2 positives + 5 queued) × 4 wide,
  # 2 FLOPs a multiply-add, fwd+bwd ×3: 3·2·2·7·4 = 336.
  assert flops.train_step_flops(2, 3, 1, 4, 8, queue=5) == 11_328 + 1_888 + 336
  assert flops.train_step_flops(2, 3, 1, 4, 8, queue=0, momentum=False) == 11_328 + 3 * 2 * 2 * 2 * 4
