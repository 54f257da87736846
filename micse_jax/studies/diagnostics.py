"""Diagnostics of one trained model: attention agreement of dropout views, STS scatter, alignment/uniformity.

* miCSE App. D (Fig. 8): for each slice (layer, head), the joint 2-D histogram of the log
  attention probabilities of the same sentences under two dropout masks, titled with the slice's
  mutual information (AMI's Gaussian estimate, Eq. 4, averaged over sentences).
* miCSE App. C (Fig. 7): cosine similarity of the embeddings against the gold score on STS-B test.
* attention entropy per slice: H = -Σ_k p_qk log p_qk over the valid keys k of each valid query
  q, averaged over queries and sentences (deterministic forward): how peaked the attention AMI
  acts on is (log T for uniform attention over T tokens, 0 for one-hot).
* Wang & Isola (ICML 2020), as in SimCSE Fig. 2: on L2-normalised embeddings,
  alignment = E_(x,y)~pos ||f(x) - f(y)||^2 over STS-B test pairs with gold > 4, and
  uniformity = log E_(x,y)~data exp(-2 ||f(x) - f(y)||^2) over distinct STS-B test sentences.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from micse_jax.augmentation.dropout_views import two_dropout_views
from micse_jax.losses.alignment import alignment, uniformity
from micse_jax.losses.ami import attention_mutual_information
from micse_jax.models.bert import BertModel, collect_attentions
from micse_jax.optional import require
from micse_jax.studies.plots import pyplot, save_figure


def alignment_uniformity(positive1, positive2, embeddings) -> tuple[float, float]:
  """(alignment of the positive pairs' rows, uniformity of `embeddings`): `losses/alignment.py`."""
  return (float(alignment(jnp.asarray(positive1), jnp.asarray(positive2))),
          float(uniformity(jnp.asarray(embeddings))))


def dropout_attention(encoder, sentences: list[str], seed: int = 0, max_length: int = 32):
  """Attention `[L, B, H, T, T]` of two dropout views of `sentences` (train-mode forward, as in training)."""
  config = encoder.model.config
  model = BertModel(config, sow_attention_layers=tuple(range(config.num_hidden_layers)))
  batch = {k: jnp.asarray(v) for k, v in encoder.tokenizer(sentences, max_length).items()}
  _, _, att1, att2 = two_dropout_views(model, encoder.params, batch, batch, jax.random.PRNGKey(seed))
  return att1, att2, batch["attention_mask"]


def slice_mutual_information(att1, att2, mask, seed: int = 0, num_samples: int = 150) -> np.ndarray:
  """`[L, H]` mean AMI (Eq. 4) per (layer, head) slice over the sentences."""
  num_layers, _, heads = att1.shape[:3]
  result = attention_mutual_information(att1, att2, mask, jax.random.PRNGKey(seed + 1),
                                        num_samples=num_samples, heads_per_slice=1)
  weight = np.asarray(result.weight)
  mi = np.sum(np.asarray(result.mi) * weight, axis=0) / np.maximum(weight.sum(0), 1)
  return mi.reshape(num_layers, heads)


def attention_entropy(attention, mask) -> np.ndarray:
  """`[L, H]` mean entropy (nats) of the attention rows `[L, B, H, T, T]` over valid queries/keys."""
  att = np.asarray(attention, np.float64)
  valid = np.asarray(mask).astype(bool)                                  # [B, T]
  keys = valid[None, :, None, None, :]
  p = np.where(keys, att, 0.0)
  h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)  # [L, B, H, T]
  queries = np.broadcast_to(valid[None, :, None, :], h.shape)
  return np.sum(np.where(queries, h, 0.0), axis=(1, 3)) / np.sum(queries, axis=(1, 3))


def deterministic_attention(encoder, sentences: list[str], max_length: int = 32):
  """Attention `[L, B, H, T, T]` of the eval-mode forward (no dropout) and the attention mask."""
  config = encoder.model.config
  model = BertModel(config, sow_attention_layers=tuple(range(config.num_hidden_layers)))
  batch = {k: jnp.asarray(v) for k, v in encoder.tokenizer(sentences, max_length).items()}
  _, state = model.apply({"params": encoder.params}, batch["input_ids"], batch["attention_mask"],
                         batch["token_type_ids"], deterministic=True, mutable=["intermediates"])
  return collect_attentions(state["intermediates"], tuple(range(config.num_hidden_layers))), batch["attention_mask"]


def attention_histograms(att1, att2, mask, mi: np.ndarray, path: str) -> str:
  """Grid of per-slice 2-D histograms of log attention, view 1 vs view 2 (cells > 0 in both)."""
  a1, a2 = np.asarray(att1), np.asarray(att2)
  tokens = np.asarray(mask).astype(bool)
  pairs = tokens[:, :, None] & tokens[:, None, :]
  num_layers, _, heads = a1.shape[:3]
  plt, colors = pyplot(), require("matplotlib.colors", "drawing figures (analyze)")
  fig, axes = plt.subplots(num_layers, heads, figsize=(2.6 * heads, 2.4 * num_layers), squeeze=False)
  for layer in range(num_layers):
    for head in range(heads):
      x, y = a1[layer][:, head], a2[layer][:, head]
      keep = pairs & (x > 0) & (y > 0)
      ax = axes[layer, head]
      ax.hist2d(np.log(x[keep]), np.log(y[keep]), bins=40, cmap="viridis", norm=colors.LogNorm())
      ax.set_title(f"layer {layer} head {head}: MI {mi[layer, head]:.2f}", fontsize=8)
      ax.tick_params(labelsize=6)
      if layer == num_layers - 1:
        ax.set_xlabel("log attention, view 1", fontsize=7)
      if head == 0:
        ax.set_ylabel("log attention, view 2", fontsize=7)
  return save_figure(fig, path, dpi=110)


def cosine_vs_gold(cosines: np.ndarray, gold: np.ndarray, path: str) -> tuple[str, float]:
  """Scatter of cosine against gold score; returns (path, Spearman x100)."""
  rho = float(stats.spearmanr(cosines, gold).correlation * 100)
  fig, ax = pyplot().subplots(figsize=(5, 4))
  ax.scatter(gold, cosines, s=4, alpha=0.4)
  ax.set_xlabel("gold similarity (0-5)")
  ax.set_ylabel("cosine of embeddings")
  ax.set_title(f"STS-B test: Spearman {rho:.2f}")
  ax.grid(alpha=0.3)
  return save_figure(fig, path, dpi=110), rho


def alignment_uniformity_plot(align: float, uniform: float, label: str, path: str) -> str:
  """One labelled point on the alignment–uniformity plane (SimCSE Fig. 2)."""
  fig, ax = pyplot().subplots(figsize=(4.5, 4))
  ax.scatter([uniform], [align], s=60, color="tab:red")
  ax.annotate(label, (uniform, align), textcoords="offset points", xytext=(6, 6), fontsize=8)
  ax.set_xlabel("uniformity (lower is better)")
  ax.set_ylabel("alignment (lower is better)")
  ax.set_title("Alignment-uniformity (STS-B test)")
  ax.margins(0.5)
  ax.grid(alpha=0.3)
  return save_figure(fig, path, dpi=110)
