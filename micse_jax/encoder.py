"""`SentenceEncoder`: sentences in, float32 embeddings out.

Sentences are sorted by length and batched so each jit-compiled shape is a (batch_size,
bucket_length) pair: a handful of programs, not one per batch, compiled once per encoder and
reused with any params. `plan` tokenizes and batches a sentence list once; `encode_plan` embeds a
plan (dev selection scores the same dev set every `eval_every` steps without re-tokenizing it).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from micse_jax import pooling, workdir
from micse_jax.models.bert import BertConfig, BertModel
from micse_jax.models.heads import MLPHead
from micse_jax.models.loading import load_pretrained
from micse_jax.tokenization import DEFAULT_BUCKETS, Tokenizer, bucket_length


@dataclasses.dataclass(frozen=True)
class EncodePlan:
  """Sentences tokenized and batched once: `batches` holds (input rows, padded token batch) pairs."""
  num_sentences: int
  batches: list


class SentenceEncoder:
  """A BERT encoder, its parameters and tokenizer, plus the optional trained MLP head.

  `cls` pooling uses the trained MLP head when there is one (a miCSE/SimCSE training run),
  otherwise BERT's own pooler (dense + tanh), as `BertModel.pooler_output` in HF.
  """

  def __init__(self, model: BertModel, params: dict, tokenizer: Tokenizer,
               head_params: dict | None = None, model_dir: str | None = None):
    self.model = model
    self.params = params
    self.tokenizer = tokenizer
    self.head_params = head_params
    self.model_dir = model_dir
    self.head = MLPHead(model.config.hidden_size)

  @classmethod
  def from_pretrained(cls, path_or_name: str, dtype=jnp.float32) -> "SentenceEncoder":
    """An encoder from a HF directory or hub name (no trained MLP head); a training workdir is
    `load_encoder(path)`'s (its best checkpoint, else its latest, with its trained head)."""
    if workdir.is_workdir(path_or_name):
      return load_encoder(path_or_name, dtype=dtype)
    model, params, _, model_dir = load_pretrained(path_or_name, dtype=dtype)
    return cls(model, params, Tokenizer.from_pretrained(model_dir), model_dir=model_dir)

  @property
  def hidden_size(self) -> int:
    """The embedding width."""
    return self.model.config.hidden_size

  @functools.partial(jax.jit, static_argnums=(0, 4))
  def _embed(self, params, head_params, batch, pooler: str):
    out = self.model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                           batch["token_type_ids"], deterministic=True)
    if pooler == "avg":
      return pooling.masked_mean(out.last_hidden_state, batch["attention_mask"]).astype(jnp.float32)
    cls_hidden = pooling.cls_before_pooler(out.last_hidden_state)
    if pooler == "cls":
      cls_hidden = self.head.apply({"params": head_params}, cls_hidden) if head_params is not None \
          else out.pooler_output
    return cls_hidden.astype(jnp.float32)

  def plan(self, sentences: Sequence[str], batch_size: int = 64, max_length: int = 128,
           buckets: Sequence[int] = DEFAULT_BUCKETS) -> EncodePlan:
    """Tokenizes and batches `sentences` once (sorted by length, padded to a bucket length)."""
    if isinstance(sentences, str):
      raise TypeError("encode expects a list of sentences, not a single string")
    ids = self.tokenizer.token_ids(sentences, max_length)
    order = np.argsort([len(s) for s in ids], kind="stable")
    batches = []
    for start in range(0, len(order), batch_size):
      rows = order[start:start + batch_size]
      length = bucket_length(max(len(ids[r]) for r in rows), max_length, buckets)
      batch = self.tokenizer.pad([ids[r] for r in rows] + [[]] * (batch_size - len(rows)), length)
      batch["attention_mask"][len(rows):, 0] = 1  # filler rows: one real token, results dropped
      batches.append((rows, batch))
    return EncodePlan(len(ids), batches)

  def encode_plan(self, plan: EncodePlan, pooler: str = "cls_before_pooler", *,
                  params: dict | None = None, head_params: dict | None = None) -> np.ndarray:
    """Embeds a `plan`'s sentences → float32 `[n, hidden]` in input order (no tokenization)."""
    params = self.params if params is None else params
    head_params = self.head_params if head_params is None else head_params
    pooling.check_pooler(pooler)
    out = np.zeros((plan.num_sentences, self.hidden_size), np.float32)
    pending = None  # (rows, device result) of the previous batch: the next dispatch overlaps it
    for rows, batch in plan.batches:
      emb = self._embed(params, head_params, batch, pooler)  # dispatched asynchronously
      if pending is not None:
        out[pending[0]] = np.asarray(pending[1])[:len(pending[0])]
      pending = (rows, emb)
    if pending is not None:
      out[pending[0]] = np.asarray(pending[1])[:len(pending[0])]
    return out

  def compile_plan(self, plan: EncodePlan, pooler: str = "cls_before_pooler", *, params: dict | None = None,
                   head_params: dict | None = None) -> None:
    """Compiles what `encode_plan` of `plan` will run (one program per distinct batch shape) by
    embedding one batch of each shape, waited for: a trainer does it before its first step."""
    params = self.params if params is None else params
    head_params = self.head_params if head_params is None else head_params
    first_of_shape = {batch["input_ids"].shape: batch for _, batch in plan.batches}
    for batch in first_of_shape.values():
      jax.block_until_ready(self._embed(params, head_params, batch, pooler))

  def encode(self, sentences: Sequence[str], pooler: str = "cls_before_pooler",
             batch_size: int = 64, max_length: int = 128,
             buckets: Sequence[int] = DEFAULT_BUCKETS, *, params: dict | None = None,
             head_params: dict | None = None) -> np.ndarray:
    """Embeds `sentences` → float32 `[n, hidden]` in input order.

    `params` / `head_params` replace the encoder's own for this call (e.g. a training state's),
    reusing the compiled programs; the encoder itself is not changed.
    """
    pooling.check_pooler(pooler)
    if isinstance(sentences, str):
      raise TypeError("encode expects a list of sentences, not a single string")
    if not sentences:
      return np.zeros((0, self.hidden_size), np.float32)
    return self.encode_plan(self.plan(sentences, batch_size, max_length, buckets), pooler,
                            params=params, head_params=head_params)

  def __hash__(self):
    return id(self)

  def __eq__(self, other):
    return self is other


def load_encoder(path_or_name: str, checkpoint: str | int = "best", dtype=jnp.float32,
                 allow_stopped: bool = False) -> SentenceEncoder:
  """A HF directory, a hub name, or a training workdir (its 'best', 'latest' or a step). A
  population workdir is no one encoder, and a population member that stopped (a non-finite update)
  is no trained one unless `allow_stopped`: each is a one-line `CheckpointError` (`workdir.one_run`)."""
  if not workdir.is_workdir(path_or_name):
    return SentenceEncoder.from_pretrained(path_or_name, dtype=dtype)
  if checkpoint == "best" and not workdir.best_manager(path_or_name, read_only=True).all_steps():
    checkpoint = "latest"  # a run without dev evaluation has no best checkpoint
  restored = workdir.restore_trained_weights(path_or_name, checkpoint, allow_stopped)
  config: BertConfig = restored["bert_config"]
  as_jax = lambda tree: jax.tree.map(jnp.asarray, tree)
  return SentenceEncoder(BertModel(config, dtype=dtype), as_jax(restored["encoder_params"]),
                         Tokenizer.from_pretrained(restored["tokenizer_dir"]),
                         head_params=as_jax(restored["head_params"]), model_dir=restored["tokenizer_dir"])
