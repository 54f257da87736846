"""Export Flax parameters as a Hugging Face `BertModel` / sentence-transformers directory.

RoBERTa checkpoints export the same way, as `RobertaModel` (same parameter names).

The directory holds `config.json`, `model.safetensors`, the tokenizer files and the
sentence-transformers files (Transformer + [CLS]-token Pooling), so that all of
`transformers.AutoModel.from_pretrained(dir)`, `SentenceTransformer(dir)`,
`micse_jax.models.load_pretrained(dir)` and SimCSE's `evaluation.py --pooler
cls_before_pooler` read it.

Pooler slot (HF `BertModel` always has one, and warns when its weights are absent):
  * `mlp_as_pooler=True`: the trained MLP head (`MLPHead` params) goes there, so HF
    `pooler_output` is the train-time representation (SimCSE's `--pooler cls`).
  * else the encoder's own pooler (the pretrained NSP pooler) when the params have one;
  * else an all-zero pooler, with a warning: `pooler_output` is then exactly 0, which no one
    can mistake for a trained representation, while `last_hidden_state` (and so the
    [CLS]-before-pooler embedding used for evaluation) is unaffected.
An MLM head (`cls/...`) is dropped: `BertModel` has no slot for it.

The export is built in a temporary directory beside the output and renamed into place at the
end, so a failure never leaves a half-written export behind. Errors are `ExportError`s with a
one-line message.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from typing import Iterator

import flax
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from micse_jax import jsonio
from micse_jax.errors import ExportError  # re-exported
from micse_jax.models import weights
from micse_jax.models.bert import BertConfig, BertModel

WEIGHTS_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt")
VOCAB_FILES = ("tokenizer.json", "vocab.txt", "vocab.json")
POOLING_DIR = "1_Pooling"
DEFAULT_MAX_SEQ_LENGTH = 128  # `SentenceEncoder.encode` default
_ARCHITECTURES = {"bert": "BertModel", "roberta": "RobertaModel"}
_POOLER = "pooler"
_DROPPED_HEADS = ("cls",)


def export_hf(output_dir: str, *, bert_config: BertConfig, encoder_params: dict, tokenizer_dir: str,
              head_params: dict | None = None, mlp_as_pooler: bool = False, overwrite: bool = False,
              max_seq_length: int | None = None) -> str:
  """Writes a Hugging Face `BertModel` + sentence-transformers directory; returns its path.

  Args:
    output_dir: directory to create; it must not exist or be empty unless `overwrite`.
    bert_config: the network's config (`model_type` 'bert' or 'roberta').
    encoder_params: Flax `BertModel` params (`{'embeddings':..., 'encoder':..., 'pooler'?...}`).
    tokenizer_dir: directory whose tokenizer files are copied into the export.
    head_params: the trained `MLPHead` params `{'dense': {'kernel', 'bias'}}`, if any.
    mlp_as_pooler: put `head_params` into BERT's pooler slot (HF `pooler_output` = MLP head).
    overwrite: replace an existing non-empty `output_dir`.
    max_seq_length: sentence-transformers truncation length (default 128, capped at the
      number of positions the model has).

  Raises:
    ExportError: unsupported model, inconsistent params, no tokenizer, or output exists.
  """
  output_dir = os.path.abspath(os.path.expanduser(output_dir))
  _check_model_type(bert_config)
  check_output(output_dir, overwrite)
  state = encoder_state_dict(bert_config, encoder_params, head_params, mlp_as_pooler)
  tokenizer_files = _tokenizer_files(tokenizer_dir)
  max_seq_length = _max_seq_length(bert_config, max_seq_length)
  with _atomic_dir(output_dir, overwrite) as tmp:
    write_config(tmp, bert_config)
    write_weights(tmp, state)
    for path in tokenizer_files:
      shutil.copy2(path, tmp)
    write_sentence_transformers_files(tmp, bert_config.hidden_size, max_seq_length)
  logging.info("exported %d tensors to %s", len(state), output_dir)
  return output_dir


def _check_model_type(config: BertConfig) -> None:
  if config.model_type not in _ARCHITECTURES:
    raise ExportError(f"export supports model_type {sorted(_ARCHITECTURES)} only, "
                              f"not {config.model_type!r}")


def check_output(output_dir: str, overwrite: bool) -> None:
  """Refuses a file, or a non-empty directory without `overwrite`."""
  if os.path.isfile(output_dir) or os.path.islink(output_dir):
    raise ExportError(f"output path exists and is not a directory: {output_dir}")
  if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
    raise ExportError(f"output directory exists and is not empty: {output_dir} "
                      "(set overwrite / --overwrite to replace it)")


def _max_seq_length(config: BertConfig, requested: int | None) -> int:
  """The requested length, else 128; at most the positions left after RoBERTa's offset."""
  longest = config.max_position_embeddings - config.position_offset
  if requested is None:
    return min(DEFAULT_MAX_SEQ_LENGTH, longest)
  if not 0 < requested <= longest:
    raise ExportError(f"max_seq_length {requested} must be in [1, {longest}]")
  return requested


def _expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
  """Flax path → shape of every `BertModel` parameter (with pooler, no MLM head)."""
  dummy = jnp.zeros((1, 2), jnp.int32)
  tree = jax.eval_shape(lambda: BertModel(config).init(jax.random.PRNGKey(0), dummy, dummy))["params"]
  return {path: tuple(leaf.shape) for path, leaf in weights.flatten(tree)}


def encoder_state_dict(config: BertConfig, encoder_params: dict, head_params: dict | None = None,
                       mlp_as_pooler: bool = False) -> dict[str, np.ndarray]:
  """HF `BertModel` state dict (float32 numpy), pooler chosen as the module docstring says."""
  params = flax.core.unfreeze(encoder_params)
  for name in _DROPPED_HEADS:
    if params.pop(name, None) is not None:
      logging.info("dropping the %r head: HF BertModel has no slot for it", name)
  if mlp_as_pooler:
    params[_POOLER] = _checked_head(head_params, config.hidden_size)
  elif _POOLER not in params:
    logging.warning("encoder params have no pooler: exporting an all-zero pooler "
                    "(HF pooler_output will be 0; [CLS]-before-pooler embeddings are unaffected)")
    params[_POOLER] = _zero_pooler(config.hidden_size)
  _check_shapes(params, _expected_shapes(config))  # so every path has a HF name below
  return weights.flax_params_to_hf_state_dict(params)


def _checked_head(head_params: dict | None, hidden: int) -> dict:
  """Validates an `MLPHead` tree `{'dense': {'kernel': [H, H], 'bias': [H]}}`."""
  if head_params is None:
    raise ExportError("mlp_as_pooler needs head_params (the trained MLP head), but none were given")
  try:
    dense = flax.core.unfreeze(head_params)["dense"]
    kernel, bias = dense["kernel"], dense["bias"]
  except (KeyError, TypeError) as e:
    raise ExportError("head_params must be an MLPHead tree {'dense': {'kernel', 'bias'}}") from e
  if np.shape(kernel) != (hidden, hidden) or np.shape(bias) != (hidden,):
    raise ExportError(f"MLP head shapes kernel {np.shape(kernel)} / bias {np.shape(bias)} do not fit "
                      f"hidden_size {hidden}")
  return {"dense": {"kernel": kernel, "bias": bias}}


def _zero_pooler(hidden: int) -> dict:
  zeros = lambda *shape: np.zeros(shape, np.float32)
  return {"dense": {"kernel": zeros(hidden, hidden), "bias": zeros(hidden)}}


def _check_shapes(params: dict, expected: dict[str, tuple[int, ...]]) -> None:
  """Every expected parameter present with the config's shape, nothing unknown."""
  flat = dict(weights.flatten(params))
  for path, shape in expected.items():
    if path not in flat:
      raise ExportError(f"encoder params lack {path}, which the config needs")
    if tuple(np.shape(flat[path])) != shape:
      raise ExportError(f"shape mismatch for {path}: params {tuple(np.shape(flat[path]))}, "
                        f"config expects {shape}")
  unknown = sorted(set(flat) - set(expected))
  if unknown:
    raise ExportError(f"encoder params hold {len(unknown)} entries BertModel does not have, "
                      f"e.g. {unknown[0]}")


def _tokenizer_files(tokenizer_dir: str) -> list[str]:
  """Paths of the tokenizer files in `tokenizer_dir`; at least one vocabulary is required."""
  if not os.path.isdir(tokenizer_dir):
    raise ExportError(f"tokenizer directory does not exist: {tokenizer_dir}")
  present = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, n))]
  if not any(n in present for n in VOCAB_FILES):
    raise ExportError(f"no tokenizer files ({' or '.join(VOCAB_FILES)}) in {tokenizer_dir}")
  return [os.path.join(tokenizer_dir, n) for n in present]


def hf_config_dict(config: BertConfig) -> dict:
  """The `config.json` contents HF `AutoConfig` needs for `config`."""
  return {"architectures": [_ARCHITECTURES[config.model_type]], **config.to_dict(),
          "position_embedding_type": "absolute", "torch_dtype": "float32"}


def _write_json(path: str, obj) -> None:
  jsonio.write_json(path, obj, sort_keys=True)


def write_config(directory: str, config: BertConfig) -> None:
  """Writes the HF `config.json` of `config` into `directory`."""
  _write_json(os.path.join(directory, "config.json"), hf_config_dict(config))


def write_weights(directory: str, state: dict[str, np.ndarray]) -> None:
  """`model.safetensors` with the `format: pt` metadata transformers checks for."""
  save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()},
            os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})


def write_sentence_transformers_files(directory: str, hidden_size: int, max_seq_length: int) -> None:
  """modules.json (Transformer → Pooling), sentence_bert_config.json, [CLS] pooling config.

  Uses the classic (v2-era) file format, which current sentence-transformers still reads.
  """
  _write_json(os.path.join(directory, "modules.json"), [
      {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
      {"idx": 1, "name": "1", "path": POOLING_DIR, "type": "sentence_transformers.models.Pooling"}])
  _write_json(os.path.join(directory, "sentence_bert_config.json"),
              {"max_seq_length": max_seq_length, "do_lower_case": False})
  os.makedirs(os.path.join(directory, POOLING_DIR))
  _write_json(os.path.join(directory, POOLING_DIR, "config.json"), {
      "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": True,
      "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
      "pooling_mode_mean_sqrt_len_tokens": False})


@contextlib.contextmanager
def _atomic_dir(output_dir: str, overwrite: bool) -> Iterator[str]:
  """Yields a temp dir beside `output_dir`; on success it replaces `output_dir`, else vanishes."""
  parent = os.path.dirname(output_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.tmp-", dir=parent)
  try:
    yield tmp
    _make_readable(tmp)
    _publish(tmp, output_dir, overwrite)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _make_readable(directory: str) -> None:
  """Gives the tree the umask's usual modes (mkdtemp and safetensors create private ones)."""
  umask = os.umask(0)
  os.umask(umask)
  for root, _, files in os.walk(directory):
    os.chmod(root, 0o777 & ~umask)
    for name in files:
      os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _publish(tmp: str, output_dir: str, overwrite: bool) -> None:
  """Renames `tmp` to `output_dir`; with `overwrite` an existing one is moved aside, then deleted."""
  if not overwrite or not os.path.isdir(output_dir) or not os.listdir(output_dir):
    os.replace(tmp, output_dir)  # atomic; fails (ENOTEMPTY) if a non-empty dir appeared meanwhile
    return
  old = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.old-", dir=os.path.dirname(output_dir))
  os.replace(output_dir, old)
  try:
    os.replace(tmp, output_dir)
  except BaseException:
    os.replace(old, output_dir)  # put the previous export back
    raise
  shutil.rmtree(old, ignore_errors=True)
