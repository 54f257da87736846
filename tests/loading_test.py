"""Loading: each broken input gives one clear ModelLoadError; the name table round-trips."""
import json
import os
import shutil

import numpy as np
import pytest

from micse_jax.models import ModelLoadError, load_pretrained, weights
from micse_jax.models.loading import load_hf_state_dict
from tests.helpers import write_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, minilm_dir):
  return write_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("tiny")), minilm_dir, mlm=False)


def _copy(src, dst, skip=()):
  os.makedirs(dst)
  for name in os.listdir(src):
    if name not in skip and os.path.isfile(os.path.join(src, name)):
      shutil.copy(os.path.join(src, name), dst)
  return dst


def _one_line(excinfo):
  assert "\n" not in str(excinfo.value)
  return str(excinfo.value)


def test_missing_directory(tmp_path):
  with pytest.raises(ModelLoadError) as e:
    load_pretrained(str(tmp_path / "nope"))
  assert "does not exist" in _one_line(e) and "nope" in str(e.value)


def test_directory_without_weights(tmp_path, tiny_dir):
  d = _copy(tiny_dir, str(tmp_path / "noweights"), skip=("model.safetensors",))
  with pytest.raises(ModelLoadError) as e:
    load_pretrained(d)
  assert "no weights" in _one_line(e) and "model.safetensors" in str(e.value)


def test_directory_without_config(tmp_path, tiny_dir):
  d = _copy(tiny_dir, str(tmp_path / "noconfig"), skip=("config.json",))
  with pytest.raises(ModelLoadError, match="no config.json"):
    load_pretrained(d)


def test_corrupted_safetensors(tmp_path, tiny_dir):
  d = _copy(tiny_dir, str(tmp_path / "corrupt"))
  path = os.path.join(d, "model.safetensors")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(ModelLoadError) as e:
    load_pretrained(d)
  assert "corrupted" in _one_line(e) and "model.safetensors" in str(e.value)


def test_config_weight_shape_mismatch(tmp_path, tiny_dir):
  d = _copy(tiny_dir, str(tmp_path / "mismatch"))
  with open(os.path.join(d, "config.json")) as f:
    config = json.load(f)
  config["intermediate_size"] = 96
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(ModelLoadError) as e:
    load_pretrained(d)
  assert "shape mismatch" in _one_line(e) and "intermediate.dense" in str(e.value)


def test_missing_encoder_weight_is_an_error(tmp_path, tiny_dir):
  from safetensors.numpy import load_file, save_file
  d = _copy(tiny_dir, str(tmp_path / "partial"))
  state = load_file(os.path.join(d, "model.safetensors"))
  del state[next(k for k in state if "layer.1.output.dense.weight" in k)]
  save_file(state, os.path.join(d, "model.safetensors"))
  with pytest.raises(ModelLoadError, match="lacks 1 weights"):
    load_pretrained(d)


def test_pytorch_bin_checkpoint_loads_like_safetensors(tmp_path, tiny_dir):
  import torch
  d = _copy(tiny_dir, str(tmp_path / "bin"), skip=("model.safetensors",))
  state = load_hf_state_dict(tiny_dir)
  torch.save({k: torch.tensor(v) for k, v in state.items()}, os.path.join(d, "pytorch_model.bin"))
  _, p_bin, _, _ = load_pretrained(d)
  _, p_st, _, _ = load_pretrained(tiny_dir)
  for (k1, a), (k2, b) in zip(weights.flatten(p_bin), weights.flatten(p_st)):
    assert k1 == k2
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unreachable_hub_name_names_the_problem(monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(ModelLoadError) as e:
    load_pretrained("some-org/definitely-not-a-cached-model")
  assert "hub" in _one_line(e) and "definitely-not-a-cached-model" in str(e.value)


def test_inverse_name_table_restores_the_hf_state_dict(tiny_dir):
  state = {weights.normalize_hf_name(k): v for k, v in load_hf_state_dict(tiny_dir).items()
           if weights.hf_to_flax_name(weights.normalize_hf_name(k))}
  _, params, _, _ = load_pretrained(tiny_dir)
  exported = weights.flax_params_to_hf_state_dict(params)
  assert set(exported) == set(state)
  for k in state:
    np.testing.assert_array_equal(exported[k], state[k])


def test_legacy_gamma_beta_names_are_understood():
  assert weights.normalize_hf_name("bert.encoder.layer.3.output.LayerNorm.gamma") == \
      "encoder.layer.3.output.LayerNorm.weight"
  assert weights.hf_to_flax_name("encoder.layer.11.attention.self.query.weight")[0] == \
      "encoder/layer_11/attention/self/query/kernel"
