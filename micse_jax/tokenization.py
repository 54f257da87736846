"""Tokenization with Hugging Face fast tokenizers, padded to a few static lengths.

jit compiles one program per input shape, so batches are right-padded to the smallest
*bucket* length that fits their longest sentence instead of to their own maximum.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)
TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids")  # a token batch: int32 [batch, length] each


def bucket_length(longest: int, max_length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
  """Smallest bucket >= `longest`, capped at `max_length`."""
  for b in buckets:
    if b >= longest:
      return min(b, max_length)
  return max_length


class Tokenizer:
  """Wraps a HF fast tokenizer loaded from a model directory (tokenizer.json or vocab.txt)."""

  def __init__(self, hf_tokenizer):
    self.hf = hf_tokenizer

  @classmethod
  def from_pretrained(cls, model_dir: str) -> "Tokenizer":
    """The fast tokenizer of a model directory (FileNotFoundError when the directory is missing)."""
    from transformers import AutoTokenizer  # a slow import: only when a tokenizer is loaded
    if not os.path.isdir(model_dir):
      raise FileNotFoundError(f"tokenizer directory does not exist: {model_dir}")
    try:
      hf = AutoTokenizer.from_pretrained(model_dir, use_fast=True)
    except Exception as e:  # transformers raises several types here
      raise ValueError(f"no usable tokenizer files (tokenizer.json or vocab.txt) in {model_dir}: {e}") from e
    return cls(hf)

  @property
  def pad_token_id(self) -> int:
    """The [PAD] id (0 when the tokenizer names none)."""
    return int(self.hf.pad_token_id or 0)

  def token_ids(self, sentences: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids with special tokens, truncated to `max_length`, unpadded."""
    enc = self.hf(list(sentences), truncation=True, max_length=max_length,
                  padding=False, return_attention_mask=False, return_token_type_ids=False)
    return enc["input_ids"]

  def pad(self, ids: Sequence[Sequence[int]], length: int) -> dict[str, np.ndarray]:
    """Right-pads id lists to `length`; returns the int32 token-batch dict."""
    input_ids = np.full((len(ids), length), self.pad_token_id, dtype=np.int32)
    attention_mask = np.zeros((len(ids), length), dtype=np.int32)
    for row, seq in enumerate(ids):
      seq = list(seq)[:length]
      input_ids[row, :len(seq)] = seq
      attention_mask[row, :len(seq)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "token_type_ids": np.zeros_like(input_ids)}

  def __call__(self, sentences: Sequence[str], max_length: int,
               pad_to: int | None = None, buckets: Sequence[int] = DEFAULT_BUCKETS) -> dict[str, np.ndarray]:
    """Tokenizes and pads to `pad_to`, or else to the bucket of the longest sentence."""
    ids = self.token_ids(sentences, max_length)
    length = pad_to or bucket_length(max((len(s) for s in ids), default=1), max_length, buckets)
    return self.pad(ids, length)
