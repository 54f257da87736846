"""One table mapping Hugging Face PyTorch parameter names to Flax paths, and back.

Each row: (HF name pattern, Flax path pattern, hook). `{i}` stands for the layer index.
Hooks convert the array (PyTorch `nn.Linear` stores [out, in]; Flax `Dense` stores [in, out]);
each hook is its own inverse, so export uses the same table in the other direction.
"""
from __future__ import annotations

import re
from typing import Callable, Iterator

import numpy as np


def transpose(x: np.ndarray) -> np.ndarray:
  """HF Linear weight [out, in] <-> Flax Dense kernel [in, out]."""
  return np.ascontiguousarray(np.transpose(x))


def identity(x: np.ndarray) -> np.ndarray:
  """A weight that needs no layout change."""
  return x


_LAYER = "encoder.layer.{i}."
_FLAX_LAYER = "encoder/layer_{i}/"

# (HF name, Flax path, hook)
NAME_TABLE: tuple[tuple[str, str, Callable], ...] = (
    ("embeddings.word_embeddings.weight", "embeddings/word_embeddings/embedding", identity),
    ("embeddings.position_embeddings.weight", "embeddings/position_embeddings/embedding", identity),
    ("embeddings.token_type_embeddings.weight", "embeddings/token_type_embeddings/embedding", identity),
    ("embeddings.LayerNorm.weight", "embeddings/LayerNorm/scale", identity),
    ("embeddings.LayerNorm.bias", "embeddings/LayerNorm/bias", identity),
    *((_LAYER + f"attention.self.{p}.{w}", _FLAX_LAYER + f"attention/self/{p}/{f}", h)
      for p in ("query", "key", "value")
      for w, f, h in (("weight", "kernel", transpose), ("bias", "bias", identity))),
    (_LAYER + "attention.output.dense.weight", _FLAX_LAYER + "attention/output/dense/kernel", transpose),
    (_LAYER + "attention.output.dense.bias", _FLAX_LAYER + "attention/output/dense/bias", identity),
    (_LAYER + "attention.output.LayerNorm.weight", _FLAX_LAYER + "attention/output/LayerNorm/scale", identity),
    (_LAYER + "attention.output.LayerNorm.bias", _FLAX_LAYER + "attention/output/LayerNorm/bias", identity),
    (_LAYER + "intermediate.dense.weight", _FLAX_LAYER + "intermediate/dense/kernel", transpose),
    (_LAYER + "intermediate.dense.bias", _FLAX_LAYER + "intermediate/dense/bias", identity),
    (_LAYER + "output.dense.weight", _FLAX_LAYER + "output/dense/kernel", transpose),
    (_LAYER + "output.dense.bias", _FLAX_LAYER + "output/dense/bias", identity),
    (_LAYER + "output.LayerNorm.weight", _FLAX_LAYER + "output/LayerNorm/scale", identity),
    (_LAYER + "output.LayerNorm.bias", _FLAX_LAYER + "output/LayerNorm/bias", identity),
    ("pooler.dense.weight", "pooler/dense/kernel", transpose),
    ("pooler.dense.bias", "pooler/dense/bias", identity),
    ("cls.predictions.transform.dense.weight", "cls/predictions/transform/dense/kernel", transpose),
    ("cls.predictions.transform.dense.bias", "cls/predictions/transform/dense/bias", identity),
    ("cls.predictions.transform.LayerNorm.weight", "cls/predictions/transform/LayerNorm/scale", identity),
    ("cls.predictions.transform.LayerNorm.bias", "cls/predictions/transform/LayerNorm/bias", identity),
    ("cls.predictions.bias", "cls/predictions/bias", identity),
)

# Spellings in older checkpoints, and names that carry no parameters of their own.
_LEGACY_SUFFIXES = ((".gamma", ".weight"), (".beta", ".bias"))
_ALIASES = {"cls.predictions.decoder.bias": "cls.predictions.bias"}
IGNORED_HF_NAMES = re.compile(
    r"(embeddings\.position_ids|cls\.predictions\.decoder\.weight|cls\.seq_relationship\..*"
    r"|lm_head\..*|classifier\..*|qa_outputs\..*)$")
MODEL_PREFIXES = ("bert.", "roberta.", "model.")


def _pattern_to_regex(pattern: str) -> re.Pattern:
  return re.compile("^" + re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_HF_TO_FLAX = [(_pattern_to_regex(hf), flax, hook) for hf, flax, hook in NAME_TABLE]
_FLAX_TO_HF = [(_pattern_to_regex(flax), hf, hook) for hf, flax, hook in NAME_TABLE]


def normalize_hf_name(name: str) -> str:
  """Strips a model prefix (`bert.` ...) and renames legacy `gamma`/`beta` LayerNorm params."""
  for prefix in MODEL_PREFIXES:
    if name.startswith(prefix):
      name = name[len(prefix):]
      break
  for old, new in _LEGACY_SUFFIXES:
    if name.endswith(old) and "LayerNorm" in name:
      name = name[: -len(old)] + new
  return _ALIASES.get(name, name)


def hf_to_flax_name(hf_name: str) -> tuple[str, Callable] | None:
  """Flax path ('a/b/c') and hook for a normalised HF name, or None when not a model weight."""
  for regex, flax, hook in _HF_TO_FLAX:
    m = regex.match(hf_name)
    if m:
      return flax.format(**m.groupdict()), hook
  return None


def flax_to_hf_name(flax_path: str) -> tuple[str, Callable]:
  """The HF name of a Flax parameter path and the hook that converts its layout (KeyError if unknown)."""
  for regex, hf, hook in _FLAX_TO_HF:
    m = regex.match(flax_path)
    if m:
      return hf.format(**m.groupdict()), hook
  raise KeyError(f"no Hugging Face name for Flax parameter {flax_path}")


def flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
  """Yields (`'a/b/c'` path, leaf) for every leaf of a nested dict."""
  for key, value in tree.items():
    path = f"{prefix}/{key}" if prefix else key
    if isinstance(value, dict):
      yield from flatten(value, path)
    else:
      yield path, value


def unflatten(flat: dict[str, object]) -> dict:
  """The nested dict of `{'a/b/c': leaf}` (inverse of `flatten`)."""
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def flax_params_to_hf_state_dict(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
  """Inverse mapping, used by export: Flax BERT params → HF `BertModel` state dict (numpy)."""
  return {prefix + name: hook(np.asarray(value, dtype=np.float32))
          for name, hook, value in ((*flax_to_hf_name(path), value) for path, value in flatten(params))}
