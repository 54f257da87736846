"""The network-defining fields of a HF BERT/RoBERTa `config.json` (`BertConfig`) and the
activations they name; `models/bert.py` builds the network from them."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
SUPPORTED_MODEL_TYPES = ("bert", "roberta")


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """The fields of a HF BERT/RoBERTa `config.json` that define the network."""
  vocab_size: int = 30522
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = "gelu"
  hidden_dropout_prob: float = 0.1
  attention_probs_dropout_prob: float = 0.1
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  pad_token_id: int = 0
  initializer_range: float = 0.02
  model_type: str = "bert"
  dropout_random_bits: int = 32  # not HF: 16 = two dropout decisions per random word (dropout.py)
  dropout_rng_impl: str = "threefry"  # not HF: the generator of the dropout bits (dropout.RNG_IMPLS)

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"unsupported model_type {self.model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                       f"num_attention_heads {self.num_attention_heads}")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; expected one of {sorted(ACTIVATIONS)}")

  @property
  def position_offset(self) -> int:
    """RoBERTa numbers positions from pad_token_id + 1; BERT from 0."""
    return self.pad_token_id + 1 if self.model_type == "roberta" else 0

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "BertConfig":
    """A config from a HF config dict (unknown keys and None values ignored)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names and v is not None})

  @classmethod
  def from_json_file(cls, path: str) -> "BertConfig":
    """A config from a HF `config.json`."""
    with open(path, encoding="utf-8") as f:
      return cls.from_dict(json.load(f))

  def to_dict(self) -> dict[str, Any]:
    """All fields as a plain dict (JSON-serialisable)."""
    return dataclasses.asdict(self)

  def replace(self, **changes) -> "BertConfig":
    """A copy with `changes` applied."""
    return dataclasses.replace(self, **changes)


def gelu_erf(x: Array) -> Array:
  """HF `gelu`, the exact form x·Φ(x) = x · (1 + erf(x/√2)) / 2 (not the tanh approximation),
  computed in float32 and returned in x's dtype, as PyTorch's `F.gelu` computes it for half inputs.

  Written with `erf` rather than `jax.nn.gelu(approximate=False)` (whose erfc form XLA expands into
  a long polynomial): on an H100 the momentum encoder's GELU is then one kernel instead of two per
  layer, and the step keeps 0.25 GiB less (`BENCHMARKS.md`, kernel diet); the values agree to
  float32 rounding (`tests/bert_test.py`).
  """
  x32 = x.astype(jnp.float32)
  return (x32 * 0.5 * (1.0 + jax.lax.erf(x32 * np.float32(1 / np.sqrt(2))))).astype(x.dtype)


ACTIVATIONS = {"gelu": gelu_erf, "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
               "relu": jax.nn.relu, "tanh": jnp.tanh}
