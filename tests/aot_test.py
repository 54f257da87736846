"""`python -m micse_jax.bench --aot`: a tiny random BERT's step and encode program compiled deviceless for an
H100 (jax-cuda13 plugin) and a TPU v5e 2x2 slice (libtpu), their counts checked against facts of the model.

Slow set: the extras `aot` / `tpu` are ~1 GB of wheels that CI's fresh venv does not install, and each
compile takes ~30 s on a 2-core CPU. Without the extra the tests skip.
"""
import jax
import pytest

from micse_jax.aot import compile as aot_compile
from micse_jax.aot import hlo, hlo_module, topology
from micse_jax.bench import aot
from micse_jax.bench.jax_step import SHAPES

pytestmark = pytest.mark.slow
TINY = SHAPES["tiny"]  # 2 layers, hidden 64, 4 heads, intermediate 128
LAYERS, H, I = TINY["num_hidden_layers"], TINY["hidden_size"], TINY["intermediate_size"]
GEMM_KINDS = ("GEMM (cuBLAS)", "GEMM (Triton fusion)", "cuDNN fusion", "matmul fusion", "matmul (unfused)")


def tiny_bert_parameters(vocab=30522, positions=512, types=2) -> int:
  """BERT's parameter count by its architecture: embeddings + LayerNorm, per layer Q/K/V/output
  (H×H + H each), two LayerNorms, the FFN (H×I + I, I×H + H), and the pooler (H×H + H)."""
  embeddings = (vocab + positions + types) * H + 2 * H
  layer = 4 * (H * H + H) + 2 * 2 * H + (H * I + I) + (I * H + H)
  return embeddings + LAYERS * layer + H * H + H


def gemms(result: dict, phase: str) -> int:
  return sum(result["by_phase_and_kind"].get(phase, {}).get(kind, 0) for kind in GEMM_KINDS)


def compile_for(target: str, devices: int, dtype: str = "bfloat16") -> dict:
  jax.config.update("jax_platforms", "cpu")
  return aot.run(target, devices, "tiny", 8, 16, dtype)


@pytest.fixture(scope="module")
def h100():
  pytest.importorskip("jax_cuda13_plugin", reason="needs the extra 'aot' (pip install 'micse-jax[aot]')")
  return compile_for("h100", 1)


@pytest.fixture(scope="module")
def v5e():
  pytest.importorskip("libtpu", reason="needs the extra 'tpu' (pip install 'micse-jax[tpu]')")
  return compile_for("tpu-v5e", 4)


def check_step(r: dict):
  """What holds for the miCSE step on any target."""
  assert sum(r["by_kind"].values()) == sum(r["by_phase"].values()) == r["kernels_per_step"]
  for phase in ("encode (forward)", "encode (backward)", "loss/contrastive (forward)", "loss/ami (forward)",
                "momentum_forward", "optimizer", "enqueue"):
    assert r["by_phase"].get(phase, 0) > 0, phase
  assert "ema" not in r["by_phase"]  # the EMA runs inside the update's one pass (training/update.py)
  assert r["update_kernels_per_step"] == sum(r["by_phase"].get(p, 0) for p in hlo.UPDATE_PHASES) > 0
  # Per layer at least Q/K/V (possibly one merged GEMM), the attention output, two FFN GEMMs; at most
  # six dense GEMMs and the two attention products; plus the MLP head's two.
  for phase in ("encode (forward)", "momentum_forward"):
    assert 4 * LAYERS <= gemms(r, phase) <= 8 * LAYERS + 4, (phase, r["by_phase_and_kind"][phase])
  assert gemms(r, "encode (backward)") >= gemms(r, "encode (forward)")  # dX and dW per weight GEMM
  # The state alone holds params, the EMA encoder and two Adam moments in float32.
  assert r["peak_bytes_per_device"] > 4 * 4 * tiny_bert_parameters()


def test_h100_step_kernels_memory_and_encode_attention(h100):
  check_step(h100)
  assert h100["device_kind"].startswith("NVIDIA H100")
  assert sum(v["count"] for v in h100["collectives"].values()) == 0  # one device
  assert h100["by_kind"].get("sort", 0) >= 1  # AMI's top-k
  from micse_jax.kernels.choice import cudnn_takes
  with_cudnn = cudnn_takes((8, 16, 4, 16), (8, 16, 4, 16), (8, 1, 16, 16), "bfloat16")
  assert h100["encode_cudnn_attention_calls"] == (LAYERS if with_cudnn else 0)  # one per layer in eval mode


def test_one_run_over_several_h100s_shards_its_state_by_default(h100):
  """`mesh.shard_state` unset: one GPU keeps the state whole, four split it (FSDP, `state_placement.shards_state`):
  each device holds about a quarter of the state (the word embeddings and every matrix; only small
  leaves stay whole), the gradients reach their quarters by reduce-scatter."""
  jax.config.update("jax_platforms", "cpu")
  four = aot.run("h100", 4, "tiny", 8, 16, "bfloat16", encode=False)
  assert h100["state_layout"] == "replicated" and four["state_layout"] == "sharded"
  assert four["memory_per_device"]["arguments"] < 0.4 * h100["memory_per_device"]["arguments"]
  assert four["collectives"]["reduce-scatter"]["count"] > 0 and four["collectives"]["all-gather"]["count"] > 0


def test_h100_float32_encode_never_uses_cudnn_attention():
  pytest.importorskip("jax_cuda13_plugin", reason="needs the extra 'aot'")
  jax.config.update("jax_platforms", "cpu")
  compiled, _ = aot_compile.compile_encode(topology.target_devices("h100")[0], aot.bert_config_for("tiny"), 8, 16,
                                          "float32")
  assert hlo.summary(hlo_module.parse(compiled.as_text()))["by_kind"].get("attention (cuDNN)", 0) == 0


def test_h100_population_step_is_one_program_holding_every_member(h100):
  """A population of 3 (training/population.py) compiles to one vmapped program: about the single
  step's kernels (not 3 programs' worth), and memory for 3 members' float32 state."""
  jax.config.update("jax_platforms", "cpu")
  pop = aot.run("h100", 1, "tiny", 8, 16, "bfloat16", encode=False, population=3)
  assert pop["population"] == 3
  assert pop["kernels_per_step"] < 2 * h100["kernels_per_step"]  # one vmapped program, not three
  assert pop["peak_bytes_per_device"] > 3 * 4 * 4 * tiny_bert_parameters()  # params, EMA, mu, nu per member
  assert pop["peak_bytes_per_member"] > 4 * 4 * tiny_bert_parameters()  # at least one member's state
  assert sum(v["count"] for v in pop["collectives"].values()) == 0


def test_tpu_v5e_four_chips_step_has_gradient_collectives(v5e):
  check_step(v5e)
  assert v5e["num_devices"] == 4 and "v5" in v5e["device_kind"].lower()
  assert v5e["state_layout"] == "replicated"  # no calibrated TPU prices to choose FSDP by
  assert v5e["encode_cudnn_attention_calls"] == 0
  reduced = v5e["collectives"]["all-reduce"]["bytes"] + v5e["collectives"]["reduce-scatter"]["bytes"]
  assert reduced >= 4 * tiny_bert_parameters() / 4  # the float32 gradients leave each chip (at least a shard)


def test_unknown_target_is_a_config_error():
  from micse_jax.errors import ConfigError
  with pytest.raises(ConfigError):
    topology.target_devices("tpu-v9")


def test_h100_blocked_step_reports_its_blocks_and_auto_takes_what_fits(h100, monkeypatch):
  """`--chunk_size 4` at batch 8: the block loops run the encoder's kernels once per block in each pass, so
  more kernels a step (the extra forward pass); `auto` under the whole step's peak takes the whole batch
  (tried first: one compile)."""
  from micse_jax.training import chunk_choice
  jax.config.update("jax_platforms", "cpu")
  blocked = aot.run("h100", 1, "tiny", 8, 16, "bfloat16", encode=False, chunk_size="4")
  assert blocked["chunk_size"] == "4" and blocked["chunk_size_resolved"] == 4 and h100["chunk_size_resolved"] == 0
  assert blocked["kernels_per_step"] > h100["kernels_per_step"]
  whole = h100["peak_bytes_per_device"]
  monkeypatch.setattr(chunk_choice, "memory_limit", lambda device: (whole, "the whole step's peak"))
  chosen = aot.run("h100", 1, "tiny", 8, 16, "bfloat16", encode=False, chunk_size="auto")
  assert chosen["chunk_size"] == "auto" and chosen["chunk_size_resolved"] == 0
  assert chosen["peak_bytes_per_device"] == whole and chosen["kernels_per_step"] == h100["kernels_per_step"]
