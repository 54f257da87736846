"""Model FLOPs of one miCSE train step, the numerator of MFU.

MFU counts the FLOPs the model needs, not what the compiler happened to run: 2 FLOPs per
multiply-add of every matrix product, the backward pass twice the forward, no rematerialisation
(the convention of PaLM, Chowdhery et al. 2022, appendix B). XLA's own count is no substitute on
a GPU: its cost analysis does not see inside cuBLAS calls and GEMM fusions (on an H100 it gave
0.09 TFLOP for a float32 BERT-base step at batch 50 that needs 1.9, and fewer at batch 64 than at 50).

Per sequence of T tokens, one BERT layer of width H, feed-forward width I, forward:

    Q, K, V and output projections      4 · 2TH²
    feed-forward up and down            2 · 2THI
    scores QKᵀ and probabilities · V    2 · 2T²H

The step (`training/step.py`): the online encoder and the MLP head on both dropout views of B
sentences, forward and backward (3 × forward); the momentum encoder and head on one view,
forward only, when the momentum encoder is on; the similarity of B anchors to B positives and
Q queued negatives, forward and backward. Embedding lookups, layer norms, softmaxes, dropout and
the optimizer are not matrix products and are left out: XLA's CPU count of a whole encoder
forward is 4.7 % above this count at hidden 256 (`tests/flops_test.py`), less at wider shapes.
"""
from __future__ import annotations


def layer_forward_flops(tokens: int, hidden: int, intermediate: int) -> int:
  """One transformer layer's matrix-product FLOPs for one sequence of `tokens` tokens."""
  return 8 * tokens * hidden ** 2 + 4 * tokens * hidden * intermediate + 4 * tokens ** 2 * hidden


def encoder_forward_flops(tokens: int, layers: int, hidden: int, intermediate: int) -> int:
  """A whole encoder's forward FLOPs for one sequence, plus the H×H MLP head on its CLS vector."""
  return layers * layer_forward_flops(tokens, hidden, intermediate) + 2 * hidden ** 2


def train_step_flops(batch: int, tokens: int, layers: int, hidden: int, intermediate: int,
                     queue: int = 0, momentum: bool = True) -> int:
  """Model FLOPs of one miCSE step at global batch `batch` (see the module docstring)."""
  forward = encoder_forward_flops(tokens, layers, hidden, intermediate)
  online = 3 * 2 * batch * forward
  target = batch * forward if momentum else 0
  similarity = 3 * 2 * batch * (batch + queue) * hidden
  return online + target + similarity


def step_flops_for(config, bert_config) -> int:
  """`train_step_flops` for a run's config (batch, max_length, queue) and its BERT config."""
  momentum = bool(config.momentum.enabled)
  return train_step_flops(
      config.batch_size, config.model.max_length, bert_config.num_hidden_layers,
      bert_config.hidden_size, bert_config.intermediate_size,
      queue=config.momentum.queue_size if momentum else 0, momentum=momentum)


def xla_flops(compiled) -> float | None:
  """XLA's own FLOP count of a compiled program (`jax.stages.Compiled`), or None if it gives none."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  return cost.get("flops")
