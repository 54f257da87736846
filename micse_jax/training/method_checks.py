"""Validation of the method fields (views, terms, their combinations), before anything is built.

Every bad value or combination raises `MethodConfigError` with one line that names the fields;
the CLI prints it and exits non-zero before loading weights or compiling.
"""
from __future__ import annotations

from micse_jax.errors import ConfigError


class MethodConfigError(ConfigError):
  """A config asks for an unknown method part or a combination the trainer cannot run."""


def _one_of(name: str, value, allowed) -> None:
  if value not in allowed:
    raise MethodConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise MethodConfigError(message)


def check_method_config(config) -> None:
  """Checks the method fields of `configs/methods.py` and how they combine."""
  v = config.view
  _one_of("loss.objective", config.loss.objective, ("infonce", "positive_only"))
  _one_of("view.kind", v.kind, ("dropout", "add", "span_mask"))
  _one_of("ami.variant", config.ami.variant, ("paper", "official"))
  if v.kind == "add":
    _one_of("view.add_importance", v.add_importance, ("naive", "rollout"))
    _one_of("view.add_mode", v.add_mode, ("static", "dynamic"))
    _require(v.add_threshold > 2, f"view.add_threshold={v.add_threshold} must be > 2 (ADD uses t in 8, 10, 12): "
             "with t <= 2 even [CLS] x [SEP] sentences would lose tokens")
    if v.add_mode == "static":
      _require(1 <= v.add_k <= 3, f"view.add_k={v.add_k} must be 1, 2 or 3 for static ADD")
    _require(not config.ami.enabled, "ami.enabled with view.kind='add': AMI compares attention cell by cell, "
             "but ADD removes tokens from view 2, so the two views' attention maps do not align")
  if v.kind == "span_mask":
    _require(v.span_length >= 1, f"view.span_length={v.span_length} must be >= 1")
  if config.ami.enabled and config.ami.variant == "official":
    _require(len(config.ami.layers) % 2 == 0, f"ami.variant='official' pairs layers by parity; "
             f"ami.layers={tuple(config.ami.layers)} must name an even number of layers")
  if config.ct.enabled:
    _require(not config.momentum.enabled, "ct.enabled with momentum.enabled: Contrastive Tension's second "
             "encoder is trained, not an EMA; turn momentum off")
    _require(v.kind == "dropout", f"ct.enabled with view.kind={v.kind!r}: CT's views are the two encoders")
  if config.loss.objective == "positive_only":
    _require(not config.momentum.enabled, "loss.objective='positive_only' has no negatives, "
             "so a momentum queue of negatives is meaningless; set momentum.enabled=False")
  for name, group in (("mlm", config.mlm), ("reconstruction", config.reconstruction),
                      ("infocse", config.infocse)):
    _require(group.weight >= 0, f"{name}.weight={group.weight} must be >= 0")
  _require(0 < config.mlm.prob < 1, f"mlm.prob={config.mlm.prob} must be in (0, 1)")
  _require(0 < config.infocse.mask_prob < 1, f"infocse.mask_prob={config.infocse.mask_prob} must be in (0, 1)")
  if config.infocse.enabled:
    _require(config.infocse.num_layers >= 1, f"infocse.num_layers={config.infocse.num_layers} must be >= 1")
    _require(0 <= config.infocse.pretrain_steps < config.num_train_steps,
             f"infocse.pretrain_steps={config.infocse.pretrain_steps} must be in [0, num_train_steps)")
  _require(config.analysis.num_sentences >= 2, "analysis.num_sentences must be >= 2 (uniformity needs pairs)")


def needs_mlm_head(config) -> bool:
  return bool(config.mlm.enabled or config.infocse.enabled)


def check_mlm_head(config, model_dir: str, has_head: bool) -> None:
  """MLM / InfoCSE need BERT's MLM head: from the checkpoint, or random only when asked for."""
  if needs_mlm_head(config) and not has_head and not config.model.init_mlm_head:
    user = "mlm.enabled" if config.mlm.enabled else "infocse.enabled"
    raise MethodConfigError(
        f"{user} needs an MLM head, but {model_dir} has none (no cls.predictions.* weights); use a "
        "BertForMaskedLM checkpoint or set --config.model.init_mlm_head=True for a randomly initialised head")
