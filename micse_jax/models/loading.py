"""Build Flax BERT parameters from a Hugging Face checkpoint: a local directory or a hub name.

Every failure raises `ModelLoadError` with one line that names the path, key or network problem.
"""
from __future__ import annotations

import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from micse_jax.errors import ModelLoadError  # re-exported
from micse_jax.models import weights
from micse_jax.models.bert import BertConfig, BertModel
from micse_jax.optional import require

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
HUB_FILES = ["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json",
             "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "merges.txt", "vocab.json"]
# Heads a checkpoint may lack (BertForMaskedLM has no pooler, BertModel no MLM head): these
# are initialised randomly with a warning; anything else missing is an error.
OPTIONAL_PREFIXES = ("pooler/", "cls/")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def _looks_like_local_path(name: str) -> bool:
  return name.startswith((".", "/", "~")) or os.sep in name.strip("/").split("/", 1)[-1] \
      or not _HUB_NAME.match(name)


def resolve_model_dir(path_or_name: str) -> str:
  """A local directory as is; a hub name (`bert-base-uncased`) downloaded via huggingface_hub."""
  path = os.path.expanduser(path_or_name)
  if os.path.isdir(path):
    return path
  if os.path.exists(path):
    raise ModelLoadError(f"model path is a file, expected a directory: {path}")
  if _looks_like_local_path(path_or_name):
    raise ModelLoadError(f"model directory does not exist: {path}")
  try:
    from huggingface_hub import snapshot_download
    return snapshot_download(repo_id=path_or_name, allow_patterns=HUB_FILES)
  except Exception as e:  # offline, unknown repo, auth: all reported the same way
    raise ModelLoadError(
        f"{path_or_name!r} is not a local directory and could not be fetched from the Hugging Face "
        f"hub (offline? set a local path instead): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    ) from e


def load_config(model_dir: str) -> BertConfig:
  """The `BertConfig` of a model directory's config.json (ModelLoadError when missing or invalid)."""
  path = os.path.join(model_dir, "config.json")
  if not os.path.isfile(path):
    raise ModelLoadError(f"no config.json in model directory {model_dir}")
  try:
    return BertConfig.from_json_file(path)
  except (json.JSONDecodeError, TypeError, ValueError) as e:
    raise ModelLoadError(f"invalid config {path}: {e}") from e


def load_hf_state_dict(model_dir: str) -> dict[str, np.ndarray]:
  """Reads model.safetensors (no torch needed) or else pytorch_model.bin (needs torch)."""
  st_path = os.path.join(model_dir, "model.safetensors")
  if os.path.isfile(st_path):
    return _read_safetensors(st_path)
  bin_path = os.path.join(model_dir, "pytorch_model.bin")
  if os.path.isfile(bin_path):
    return _read_torch_bin(bin_path)
  raise ModelLoadError(f"no weights in {model_dir}: expected one of {', '.join(WEIGHT_FILES)}")


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  from safetensors import safe_open
  try:
    with safe_open(path, framework="flax") as f:  # flax framework reads bf16 too
      return {k: _to_numpy(f.get_tensor(k)) for k in f.keys()}
  except Exception as e:  # safetensors raises SafetensorError / OSError on bad files
    raise ModelLoadError(f"corrupted or unreadable safetensors file {path}: {e}") from e


def _to_numpy(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x)


def _read_torch_bin(path: str) -> dict[str, np.ndarray]:
  torch = require("torch", f"reading {path} (a PyTorch pickle; or convert it to safetensors)")
  try:
    state = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:
    raise ModelLoadError(f"corrupted or unreadable PyTorch checkpoint {path}: {e}") from e
  return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}


def state_dict_to_params(state: dict[str, np.ndarray], reference: dict, source: str,
                         initializer=None) -> dict:
  """Maps a HF state dict onto the Flax tree `reference` (arrays or shapes).

  Shapes are checked; optional heads missing from the checkpoint come from `initializer()`
  (random init), or from `reference` itself when it holds arrays.
  """
  expected = dict(weights.flatten(reference))
  loaded: dict[str, np.ndarray] = {}
  for hf_name, value in state.items():
    name = weights.normalize_hf_name(hf_name)
    mapped = weights.hf_to_flax_name(name)
    if mapped is None:
      if not weights.IGNORED_HF_NAMES.match(name):
        logging.info("ignoring checkpoint weight %s", hf_name)
      continue
    path, hook = mapped
    if path not in expected:
      continue  # e.g. an MLM head the model was built without
    array = hook(value)
    if array.shape != tuple(expected[path].shape):
      raise ModelLoadError(f"shape mismatch for {hf_name} in {source}: checkpoint {array.shape}, "
                           f"config expects {tuple(expected[path].shape)} (config.json and weights disagree)")
    loaded[path] = array
  missing = [p for p in expected if p not in loaded]
  required = [p for p in missing if not p.startswith(OPTIONAL_PREFIXES)]
  if required:
    raise ModelLoadError(f"{source} lacks {len(required)} weights the config needs, e.g. {required[0]}")
  if missing:
    logging.warning("%s has no %s; initialised randomly", source, sorted({p.split('/')[0] for p in missing}))
    if initializer is not None:
      expected = dict(weights.flatten(initializer()))
  flat = {p: jnp.asarray(loaded[p] if p in loaded else expected[p], dtype=jnp.float32) for p in expected}
  return weights.unflatten(flat)


def load_pretrained(path_or_name: str, *, sow_attention_layers: tuple[int, ...] = (),
                    add_mlm_head: bool = False, dtype=jnp.float32, seed: int = 0):
  """Returns `(model, params, config, model_dir)` for a HF BERT/RoBERTa checkpoint."""
  model_dir = resolve_model_dir(path_or_name)
  config = load_config(model_dir)
  state = load_hf_state_dict(model_dir)
  model = BertModel(config, sow_attention_layers=tuple(sow_attention_layers),
                    add_mlm_head=add_mlm_head, dtype=dtype)
  params = state_dict_to_params(state, param_shapes(model), source=model_dir,
                                initializer=lambda: init_params(model, seed))
  return model, params, config, model_dir


def _init(model: BertModel, key):
  dummy = jnp.zeros((1, 2), jnp.int32)
  return model.init(key, dummy, jnp.ones_like(dummy))["params"]


def param_shapes(model: BertModel) -> dict:
  """The parameter tree as ShapeDtypeStructs (nothing computed)."""
  return jax.eval_shape(lambda: _init(model, jax.random.PRNGKey(0)))


def init_params(model: BertModel, seed: int = 0) -> dict:
  """Randomly initialised parameters (HF init: normal(0.02) kernels, zero biases)."""
  return jax.jit(lambda k: _init(model, k))(jax.random.PRNGKey(seed))


def has_mlm_head(model_dir: str) -> bool:
  """Whether the checkpoint holds BERT's MLM head (`cls.predictions.*`); reads names only."""
  names = _safetensors_names(os.path.join(model_dir, "model.safetensors"))
  if names is None:
    names = load_hf_state_dict(model_dir).keys()
  return any(weights.normalize_hf_name(n).startswith("cls.predictions.transform.") for n in names)


def _safetensors_names(path: str):
  if not os.path.isfile(path):
    return None
  from safetensors import safe_open
  try:
    with safe_open(path, framework="flax") as f:
      return list(f.keys())
  except Exception as e:  # safetensors raises SafetensorError / OSError on bad files
    raise ModelLoadError(f"corrupted or unreadable safetensors file {path}: {e}") from e
