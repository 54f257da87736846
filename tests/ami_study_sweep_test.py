"""configs/sweeps/ami_tiny.py: the AMI study's grid (docs/studies/ami/) is what its docstring says."""
import pytest

from micse_jax.studies import spec
from tests.micse_paper_sweep_test import _resolved  # a run's training config with its overrides

SWEEP_FILE = "configs/sweeps/ami_tiny.py"


def _cells(variant, tmp_path):
  runs = spec.expand(spec.load_config_file(f"{SWEEP_FILE}{variant}"), str(tmp_path))
  return [_resolved(run) for run in runs]


def test_weight_grid_adds_the_other_weights_to_the_fewshot_study(tmp_path):
  cells = _cells("", tmp_path)
  got = {(c.loss.objective, c.ami.enabled, c.ami.weight, c.data.num_sentences, c.seed) for c in cells}
  want = {(objective, True, w, n, s) for objective in ("infonce", "positive_only") for w in (2.5e-4, 2.5e-2)
          for n in (64, 0) for s in (0, 1, 2)}
  assert len(cells) == 24 and got == want
  for c in cells:  # the few-shot study's protocol, so its λ = 0 / 2.5e-3 runs are the same cells
    assert (c.num_train_steps, c.batch_size, c.optim.learning_rate, c.ami.heads_per_slice) == (250, 32, 1e-4, 1)
    assert tuple(c.ami.layers) == (0, 1) and not c.momentum.enabled and c.data.subset_seed == c.seed
  first_all = next(i for i, c in enumerate(cells) if c.data.num_sentences == 0)
  assert all(c.data.num_sentences == 64 for c in cells[:first_all])  # every n = 64 cell first


@pytest.mark.parametrize("variant, field, value", [
    (":layers", "ami.layers", (1,)), (":heads", "ami.heads_per_slice", 2), (":official", "ami.variant", "official")])
def test_structure_variants_change_one_field(tmp_path, variant, field, value):
  cells = _cells(variant, tmp_path)
  assert len(cells) == 2 and {c.loss.objective for c in cells} == {"infonce", "positive_only"}
  for c in cells:
    got = c.ami.layers if field == "ami.layers" else getattr(c.ami, field.split(".")[1])
    assert (tuple(got) if field == "ami.layers" else got) == value
    assert c.ami.weight == 2.5e-3 and c.data.num_sentences == 64 and c.seed == 0


def test_minilm_variant(tmp_path):
  cells = _cells(":minilm", tmp_path)
  assert len(cells) == 36
  for c in cells:
    assert "minilm" in c.model.name_or_path.lower() and tuple(c.ami.layers) == (-4, -3, -2, -1)
    assert c.ami.heads_per_slice == 2 and c.optim.learning_rate == 3e-5 and c.num_train_steps == 300
  assert {c.ami.weight for c in cells} == {0.0, 2.5e-3, 2.5e-2}
