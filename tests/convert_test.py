"""Export to Hugging Face / sentence-transformers: exact round trip, HF and ST parity, CLI errors."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from micse_jax import convert
from micse_jax import workdir as workdir_lib
from micse_jax.export import ExportError, export_hf
from micse_jax.models import load_pretrained, weights
from micse_jax.models.loading import load_config, load_hf_state_dict, state_dict_to_params
from micse_jax.tokenization import Tokenizer
from micse_jax.training import checkpoint
from tests.conftest import REPO
from tests.helpers import SENTENCES, write_tiny_hf_checkpoint

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, minilm_dir):
  """A random 2-layer BertForMaskedLM: no pooler in the checkpoint, an MLM head to drop."""
  return write_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("tiny")), minilm_dir, mlm=True)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
  model, params, config, _ = load_pretrained(tiny_dir, add_mlm_head=True)
  return model, params, config


@pytest.fixture(scope="module")
def head(tiny):
  rng = np.random.default_rng(0)
  hidden = tiny[2].hidden_size
  return {"dense": {"kernel": rng.normal(0, 0.2, (hidden, hidden)).astype(np.float32),
                    "bias": rng.normal(0, 0.2, (hidden,)).astype(np.float32)}}


@pytest.fixture(scope="module")
def minilm(minilm_dir):
  model, params, config, _ = load_pretrained(minilm_dir)
  return model, params, config


@pytest.fixture(scope="module")
def minilm_export(tmp_path_factory, minilm, minilm_dir):
  _, params, config = minilm
  out = str(tmp_path_factory.mktemp("export") / "minilm")
  return export_hf(out, bert_config=config, encoder_params=params, tokenizer_dir=minilm_dir)


@pytest.fixture(scope="module")
def tiny_mlp_export(tmp_path_factory, tiny, tiny_dir, head):
  _, params, config = tiny
  out = str(tmp_path_factory.mktemp("export") / "tiny_mlp")
  return export_hf(out, bert_config=config, encoder_params=params, tokenizer_dir=tiny_dir,
                   head_params=head, mlp_as_pooler=True)


@pytest.fixture(scope="module")
def minilm_batch_out(minilm, minilm_dir):
  """(batch, Flax `BertOutput`) of MiniLM on SENTENCES: one compiled forward for all checks."""
  model, params, _ = minilm
  batch = Tokenizer.from_pretrained(minilm_dir)(SENTENCES, max_length=32)
  out = jax.jit(lambda p, b: model.apply({"params": p}, b["input_ids"], b["attention_mask"],
                                         b["token_type_ids"]))(params, batch)
  return batch, out


def _flat(params):
  return {k: np.asarray(v) for k, v in weights.flatten(params)}


def _assert_params_equal(actual, expected):
  a, e = _flat(actual), _flat(expected)
  assert sorted(a) == sorted(e)
  for path in e:
    np.testing.assert_array_equal(a[path], e[path], err_msg=path)


def _hf_model(out):
  """AutoModel with its loading info; asserts nothing was missing, unexpected or resized."""
  import transformers
  model, info = transformers.AutoModel.from_pretrained(out, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
  return model.eval()


def _hf_forward(hf_model, batch):
  import torch
  with torch.no_grad():
    return hf_model(**{k: torch.tensor(np.asarray(v), dtype=torch.long) for k, v in batch.items()})


def _hf_forward_dir(model_dir):
  """Output of the HF model in `model_dir` (loaded without any missing keys) on SENTENCES."""
  return _hf_forward(_hf_model(model_dir), Tokenizer.from_pretrained(model_dir)(SENTENCES, max_length=32))


def _source_hf_forward(model_dir):
  """Output of the original (PyTorch) checkpoint in `model_dir`, e.g. a BertForMaskedLM's encoder."""
  import transformers
  model = transformers.AutoModel.from_pretrained(model_dir).eval()
  return _hf_forward(model, Tokenizer.from_pretrained(model_dir)(SENTENCES, max_length=32))


def _run_cli(*args):
  return subprocess.run([sys.executable, "-m", "micse_jax.convert", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120, check=False)


def _error_lines(result):
  return [line for line in result.stderr.splitlines() if line.strip()]


def test_export_writes_hf_and_sentence_transformers_files(minilm_export):
  names = set(os.listdir(minilm_export))
  assert {"config.json", "model.safetensors", "tokenizer.json", "vocab.txt", "tokenizer_config.json",
          "modules.json", "sentence_bert_config.json", "1_Pooling"} <= names
  assert not [n for n in os.listdir(os.path.dirname(minilm_export)) if n.startswith(".")]  # no temp dirs


def test_minilm_weights_round_trip_exactly(minilm_export, minilm):
  """The loader's own path (safetensors → Flax tree) gives back every leaf bit for bit."""
  _, params, config = minilm
  state = load_hf_state_dict(minilm_export)
  _assert_params_equal(state_dict_to_params(state, params, minilm_export), params)
  assert load_config(minilm_export) == config


def test_hf_loads_without_missing_keys_and_matches_cls(minilm_export, minilm_batch_out):
  batch, ours = minilm_batch_out
  theirs = _hf_forward(_hf_model(minilm_export), batch)
  np.testing.assert_allclose(theirs.last_hidden_state[:, 0].numpy(), np.asarray(ours.last_hidden_state[:, 0]),
                             atol=ATOL)
  np.testing.assert_allclose(theirs.pooler_output.numpy(), np.asarray(ours.pooler_output), atol=ATOL)


def test_sentence_transformers_encodes_cls_before_pooler(minilm_export, minilm_batch_out):
  from sentence_transformers import SentenceTransformer
  st = SentenceTransformer(minilm_export, device="cpu")
  assert st.max_seq_length == 128
  theirs = st.encode(SENTENCES, convert_to_numpy=True)
  ours = np.asarray(minilm_batch_out[1].last_hidden_state[:, 0])  # [CLS] before the pooler
  np.testing.assert_allclose(theirs, ours, atol=ATOL)


def test_mlp_as_pooler_puts_head_into_pooler_slot(tiny_mlp_export, head, tiny_dir):
  theirs = _hf_forward_dir(tiny_mlp_export)
  h_cls = theirs.last_hidden_state[:, 0].numpy().astype(np.float64)
  expected = np.tanh(h_cls @ head["dense"]["kernel"] + head["dense"]["bias"])
  np.testing.assert_allclose(theirs.pooler_output.numpy(), expected, atol=ATOL)
  source = _source_hf_forward(tiny_dir)  # the encoder itself is the original one
  np.testing.assert_allclose(h_cls, source.last_hidden_state[:, 0].numpy(), atol=ATOL)


def test_round_trip_through_load_pretrained(tiny_mlp_export, tiny, head):
  _, params, _ = tiny
  _, reloaded, _, _ = load_pretrained(tiny_mlp_export)
  expected = {k: v for k, v in params.items() if k != "cls"}  # BertModel has no MLM head
  expected["pooler"] = head
  _assert_params_equal(reloaded, expected)


def test_missing_pooler_exports_zero_pooler(tmp_path, tiny, tiny_dir):
  _, params, config = tiny
  no_pooler = {k: v for k, v in params.items() if k not in ("pooler", "cls")}
  out = export_hf(str(tmp_path / "out"), bert_config=config, encoder_params=no_pooler, tokenizer_dir=tiny_dir)
  theirs, source = _hf_forward_dir(out), _source_hf_forward(tiny_dir)
  assert not theirs.pooler_output.numpy().any()
  np.testing.assert_allclose(theirs.last_hidden_state.numpy(), source.last_hidden_state.numpy(), atol=ATOL)


def test_roberta_exports_as_roberta_model(tmp_path, minilm_dir):
  src = write_tiny_hf_checkpoint(str(tmp_path / "src"), minilm_dir, model_type="roberta")
  _, params, config, _ = load_pretrained(src)
  out = export_hf(str(tmp_path / "out"), bert_config=config, encoder_params=params, tokenizer_dir=src)
  assert type(_hf_model(out)).__name__ == "RobertaModel"
  theirs, source = _hf_forward_dir(out), _source_hf_forward(src)
  np.testing.assert_allclose(theirs.last_hidden_state.numpy(), source.last_hidden_state.numpy(), atol=ATOL)
  np.testing.assert_allclose(theirs.pooler_output.numpy(), source.pooler_output.numpy(), atol=ATOL)


def test_refuses_non_empty_output_and_bad_head(tmp_path, tiny, tiny_dir, head):
  _, params, config = tiny
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  with pytest.raises(ExportError, match="not empty"):
    export_hf(str(out), bert_config=config, encoder_params=params, tokenizer_dir=tiny_dir)
  bad = {"dense": {"kernel": head["dense"]["kernel"][:, :3], "bias": head["dense"]["bias"]}}
  for kwargs in ({"head_params": None}, {"head_params": bad}):
    with pytest.raises(ExportError):
      export_hf(str(tmp_path / "new"), bert_config=config, encoder_params=params, tokenizer_dir=tiny_dir,
                mlp_as_pooler=True, **kwargs)
  assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["keep.txt"]


def test_failed_export_leaves_previous_output_untouched(tmp_path, tiny, tiny_dir, monkeypatch):
  from micse_jax import export
  _, params, config = tiny
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("x")

  def fail(*args):
    raise OSError("disk full")
  monkeypatch.setattr(export, "write_sentence_transformers_files", fail)
  for target in (out, tmp_path / "fresh"):
    with pytest.raises(OSError, match="disk full"):
      export_hf(str(target), bert_config=config, encoder_params=params, tokenizer_dir=tiny_dir,
                overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["keep.txt"]


def _assert_exported_weights(out, params):
  """The export's safetensors hold exactly `params` (HF names, PyTorch layout)."""
  theirs, ours = load_hf_state_dict(out), weights.flax_params_to_hf_state_dict(params)
  assert sorted(theirs) == sorted(ours)
  for name, value in ours.items():
    np.testing.assert_array_equal(theirs[name], value, err_msg=name)


def test_convert_model_dir_with_overwrite(tmp_path, tiny_dir, tiny):
  out = tmp_path / "out"
  out.mkdir()
  (out / "stale.txt").write_text("x")
  assert convert.convert(model=tiny_dir, output=str(out), overwrite=True) == str(out)
  assert "stale.txt" not in os.listdir(out) and os.listdir(tmp_path) == ["out"]
  # The MLM checkpoint has no pooler: its randomly initialised one is not exported, zeros are.
  hidden = tiny[2].hidden_size
  zero_pooler = {"dense": {"kernel": np.zeros((hidden, hidden), np.float32),
                           "bias": np.zeros(hidden, np.float32)}}
  encoder = {k: v for k, v in tiny[1].items() if k not in ("cls", "pooler")}
  _assert_exported_weights(str(out), {**encoder, "pooler": zero_pooler})


def test_cli_refuses_existing_output(tmp_path, tiny_dir):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  result = _run_cli("--model", tiny_dir, "--output", str(out))
  assert result.returncode != 0
  lines = _error_lines(result)
  assert len(lines) == 1 and "not empty" in lines[0], result.stderr
  assert os.listdir(out) == ["keep.txt"]


def test_cli_missing_model(tmp_path):
  result = _run_cli("--model", str(tmp_path / "nope"), "--output", str(tmp_path / "out"))
  assert result.returncode != 0
  lines = _error_lines(result)
  assert len(lines) == 1 and "does not exist" in lines[0], result.stderr
  assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny, tiny_dir, head):
  """A training workdir holding one best checkpoint (step 3) of the tiny encoder + MLP head."""
  _, params, config = tiny
  path = str(tmp_path_factory.mktemp("run"))
  workdir_lib.write_run_config(path, {"bert_config": config.to_dict(), "model_dir": tiny_dir})
  encoder = {k: v for k, v in params.items() if k != "cls"}
  checkpoint.save_best(workdir_lib.best_manager(path), 3, {"encoder": encoder, "head": head}, 0.5)
  return path


def test_workdir_best_checkpoint_with_mlp_head(tmp_path, workdir, tiny, head):
  out = convert.convert(workdir=workdir, best=True, mlp_as_pooler=True, output=str(tmp_path / "out"))
  encoder = {k: v for k, v in tiny[1].items() if k not in ("cls", "pooler")}
  _assert_exported_weights(out, {**encoder, "pooler": head})


@pytest.mark.parametrize("which", [{"step": 7}, {"missing": True}, {"best": True, "step": 3}])
def test_workdir_errors_are_one_line(tmp_path, workdir, which):
  kwargs = dict(which)
  path = str(tmp_path / "nope") if kwargs.pop("missing", False) else workdir
  with pytest.raises(convert.ConvertError) as e:
    convert.convert(output=str(tmp_path / "out"), workdir=path, **kwargs)
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "out")
