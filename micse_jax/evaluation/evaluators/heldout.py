"""Held-out metrics logged by every config: alignment, uniformity and attention MI.

On a fixed held-out slice of sentences (`analysis.corpus`, lines `first_line ...`; by default
the non-wiki part of `english_mix.txt`, which no wiki1m training run sees), every `eval_every`
steps, with the evaluation representation ([CLS] before the MLP, L2-normalised):

* alignment (Wang & Isola, ICML 2020, Eq. 4 with α = 2) between two *dropout* views of each
  sentence: how close the encoder keeps a sentence to itself under the SimCSE augmentation;
* uniformity (Eq. 5, t = 2) of the deterministic embeddings;
* the mean attention MI between the two dropout views (miCSE Eq. 4, the paper estimator with
  the configured `ami.*` layers and sampling, whether or not AMI is trained), so that SimCSE
  and every relative can be compared with miCSE on the quantity AMI maximises.

The same protocol for every method (dropout views of the evaluated encoder), so the numbers
are comparable across configs; they are not the method's own training views.
"""
from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp

from micse_jax.augmentation.dropout_views import two_dropout_views
from micse_jax.losses.alignment import alignment, uniformity
from micse_jax.losses.ami import ami_loss, resolve_layers
from micse_jax.losses.infonce import l2_normalize
from micse_jax.models.bert import BertModel
from micse_jax.tokenization import TOKEN_KEYS


def read_heldout(path: str, first_line: int, num_sentences: int) -> list[str]:
  """Non-empty lines `first_line, first_line + 1, ...` of `path` (at most `num_sentences`)."""
  sentences = []
  with open(path, encoding="utf-8", errors="replace") as f:
    for i, line in enumerate(f):
      if i >= first_line and line.strip():
        sentences.append(line.strip())
        if len(sentences) == num_sentences:
          break
  return sentences


PREFIX = "analysis"  # the TensorBoard tag prefix of these metrics


def analysis_metrics(model: BertModel, ami_config, params, batch, key) -> dict[str, jax.Array]:
  """alignment / uniformity / attention MI of `params` on one token batch (see module doc);
  `model` sows the attention of the layers the MI reads."""
  k_drop, k_ami = jax.random.split(key)
  h1, h2, att1, att2 = two_dropout_views(model, params, batch, batch, k_drop)
  x1, x2 = (l2_normalize(h[:, 0].astype(jnp.float32)) for h in (h1, h2))
  a = ami_config
  _, ami = ami_loss(att1, att2, batch["attention_mask"], k_ami, weight=1.0, num_samples=a.num_samples,
                    heads_per_slice=a.heads_per_slice, pool_layers=a.pool_layers,
                    require_positive=a.require_positive)
  clean = model.apply({"params": params}, *(batch[k] for k in TOKEN_KEYS), deterministic=True)
  z = l2_normalize(clean.last_hidden_state[:, 0].astype(jnp.float32))
  return {f"{PREFIX}/alignment": alignment(x1, x2), f"{PREFIX}/uniformity": uniformity(z),
          f"{PREFIX}/attention_mi": ami["ami_mi"]}


def analysis_layers(layers, num_layers: int) -> tuple[int, ...]:
  """The configured `ami.layers` when valid for this encoder, else its top min(4, L) layers."""
  try:
    return resolve_layers(layers, num_layers)
  except ValueError:
    return tuple(range(max(0, num_layers - 4), num_layers))


class HeldoutMetrics:
  """Callable on the encoder params → host floats tagged `analysis/...`; `create` returns None
  when disabled/no data."""

  PREFIX = PREFIX

  def __init__(self, encoder, config, sentences: list[str]):
    bert_config = encoder.model.config
    layers = analysis_layers(config.ami.layers, bert_config.num_hidden_layers)
    model = BertModel(bert_config, sow_attention_layers=layers, dtype=encoder.model.dtype)
    length = config.model.max_length
    self.batch = {k: jnp.asarray(v) for k, v in encoder.tokenizer(sentences, length, pad_to=length).items()}
    self.seed = config.seed
    self.fn = jax.jit(functools.partial(analysis_metrics, model, config.ami))

  @classmethod
  def create(cls, encoder, config) -> "HeldoutMetrics | None":
    """From the `analysis.*` fields; None when off, when `eval_every` <= 0 or without the corpus."""
    a = config.analysis
    if not a.enabled or config.eval_every <= 0:
      return None
    if not os.path.isfile(a.corpus):
      logging.warning("analysis corpus not found at %s: no alignment/uniformity/attention-MI logging", a.corpus)
      return None
    sentences = read_heldout(a.corpus, a.first_line, a.num_sentences)
    if len(sentences) < 2:
      logging.warning("analysis corpus %s has < 2 sentences after line %d: no analysis", a.corpus, a.first_line)
      return None
    return cls(encoder, config, sentences)

  def __call__(self, encoder_params) -> dict[str, float]:
    """The metrics of `encoder_params`, with the same dropout masks at every call."""
    key = jax.random.fold_in(jax.random.PRNGKey(self.seed), 0)
    return {k: float(v) for k, v in jax.device_get(self.fn(encoder_params, self.batch, key)).items()}
