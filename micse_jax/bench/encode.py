"""Encode throughput: `SentenceEncoder.encode` against sentence-transformers' `encode`.

Same model directory, same sentences, batch size, maximum length and device; both include
tokenisation. Mean pooling on both sides (sentence-transformers' default for a plain HF
directory, and the pooling of all-MiniLM-L6-v2). Each side encodes the sentences once
untimed (micse_jax compiles one program per length bucket there), then `repeats` timed times.
"""
from __future__ import annotations

import os
import time

import jax.numpy as jnp
import numpy as np

from micse_jax.encoder import SentenceEncoder
from micse_jax.optional import require

WORDS = ("the a of in river city music game team school history war north people year film "
         "song album station church population village district county species family "
         "research university company season league player world national first second").split()


def sentences_for_benchmark(n: int, corpus: str | None = None, seed: int = 0) -> tuple[list[str], str]:
  """The first `n` lines of `corpus` when it exists, else `n` random word sequences (5-40 words)."""
  if corpus and os.path.isfile(corpus):
    with open(corpus, encoding="utf-8") as f:
      lines = [line.strip() for _, line in zip(range(4 * n), f) if line.strip()][:n]
    if len(lines) == n:
      return lines, corpus
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(5, 41))) for _ in range(n)], "random words"


def _timed(fn, repeats: int) -> float:
  fn()  # warm-up: compilation, caches
  best = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    best.append(time.perf_counter() - t)
  return float(np.median(best))


def encode_benchmark(model_dir: str, sentences: list[str], batch_size: int, max_length: int,
                     repeats: int = 1) -> dict:
  """Sentences/s of both encoders and their ratio; also the mean cosine of their embeddings."""
  torch = require("torch", "the sentence-transformers comparison of the bench (--encode)")
  SentenceTransformer = require("sentence_transformers", "the bench's --encode comparison").SentenceTransformer
  ours = SentenceEncoder.from_pretrained(model_dir)
  theirs = SentenceTransformer(model_dir, device="cuda" if torch.cuda.is_available() else "cpu")
  theirs.max_seq_length = max_length
  run_ours = lambda: ours.encode(sentences, "avg", batch_size=batch_size, max_length=max_length)
  run_theirs = lambda: theirs.encode(sentences, batch_size=batch_size, convert_to_numpy=True)
  t_ours, t_theirs = _timed(run_ours, repeats), _timed(run_theirs, repeats)
  a, b = run_ours(), run_theirs()
  cos = np.sum(a * b, 1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
  n = len(sentences)
  return {"sentences": n, "batch_size": batch_size, "max_length": max_length,
          "micse_jax_sentences_per_s": n / t_ours, "sentence_transformers_sentences_per_s": n / t_theirs,
          "speedup_vs_sentence_transformers": t_theirs / t_ours, "mean_cosine_between_the_two": float(cos.mean())}


def attention_comparison(model_dir: str, sentences: list[str], batch_size: int, max_length: int, dtype: str,
                         repeats: int = 3) -> dict:
  """`SentenceEncoder.encode` in `dtype` with the fused attention (`models/attention.py`: cuDNN flash
  attention on a GPU in bfloat16/float16) against the explicit softmax(QKᵀ)V: sentences/s of
  each, the cuDNN attention calls in the fused program, the largest difference of the embeddings."""
  fused = SentenceEncoder.from_pretrained(model_dir, dtype=jnp.dtype(dtype))
  explicit = SentenceEncoder(fused.model.clone(attention="explicit"), fused.params, fused.tokenizer,
                             model_dir=fused.model_dir)
  plan = fused.plan(sentences, batch_size, max_length)
  times = {name: _timed(lambda e=enc: e.encode_plan(plan, "avg"), repeats)
           for name, enc in (("fused", fused), ("explicit", explicit))}
  _, first = plan.batches[0]
  program = SentenceEncoder._embed.lower(fused, fused.params, None, first, "avg").compile().as_text()
  a, b = fused.encode_plan(plan, "avg"), explicit.encode_plan(plan, "avg")
  n = len(sentences)
  return {"sentences": n, "batch_size": batch_size, "max_length": max_length, "dtype": dtype,
          "fused_sentences_per_s": n / times["fused"], "explicit_sentences_per_s": n / times["explicit"],
          "speedup_fused_over_explicit": times["explicit"] / times["fused"],
          "cudnn_attention_calls": program.count('custom_call_target="__cudnn$fmha'),
          "max_abs_difference": float(np.max(np.abs(a - b)))}
