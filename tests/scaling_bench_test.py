"""bench --collectives (bench/scaling.py): the compiled step's memory analysis accounts for the
train state it is given, and remat lowers the temporaries (1 device, tiny BERT, compile only)."""
import jax
import numpy as np
import pytest

from micse_jax.bench import scaling
from micse_jax.models.bert import BertConfig

TINY = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=256, max_position_embeddings=64)


def _state_bytes(batch_size):
  """Bytes of the train state, from the shapes alone (independent of the compiler)."""
  from micse_jax.training import program
  config = scaling.layout_config("replicated/none", batch_size, 32, "float32", TINY.num_hidden_layers)
  shapes = program.build(config, TINY, program.abstract_encoder(config, TINY)).abstract_state
  return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))


@pytest.mark.slow  # 18 s of the default run (three compiles; CI budget)
def test_memory_analysis_accounts_for_the_state_and_remat_saves_temporaries():
  batch = 64
  reports = {layout: scaling.memory_per_device(scaling.compile_step(layout, batch, 32, "float32", TINY))
             for layout in ("replicated/none", "replicated/full")}
  state_mib = _state_bytes(batch) / scaling.MIB
  batch_mib = (3 * batch * 32 + batch) * 4 / scaling.MIB  # three int32 token arrays + sentence ids
  for memory in reports.values():
    np.testing.assert_allclose(memory["arguments"], state_mib + batch_mib, rtol=0.01)
    assert memory["aliased"] >= 0.99 * state_mib  # the donated state is updated in place
  assert reports["replicated/full"]["temporaries"] < reports["replicated/none"]["temporaries"]
  lines = scaling.report_lines([scaling.LayoutReport(k, {"all-gather": {"count": 0, "bytes": 0, "max_bytes": 0}}, v)
                                for k, v in reports.items()], batch, 32, "float32")
  assert any(line.startswith("| replicated/full |") for line in lines)
