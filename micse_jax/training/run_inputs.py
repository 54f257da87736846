"""What a run starts from, shared by the trainer and the benchmark: the checkpoint's model, weights
and tokenizer, the corpus batches (`prepare`); and the step-0 params and train state, given the
program's networks (`training/program.py` builds those, once).

Everything is built and validated before anything is written to the workdir: the checks that
need the checkpoint are here (`check_against_model`, `check_mlm_head`); `config_checks.check_config`
has run before.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import ml_collections

from micse_jax import caches, config_checks, timeline
from micse_jax.config_checks import MethodConfigError
from micse_jax.configs import population_fields
from micse_jax.data.pipeline import TrainBatches, build_train_batches
from micse_jax.errors import ConfigError
from micse_jax.models.bert import BertConfig
from micse_jax.models.heads import MLPHead
from micse_jax.models.loading import has_mlm_head, load_config, load_pretrained, resolve_model_dir
from micse_jax.tokenization import Tokenizer
from micse_jax.training import data_parallel, population_placement
from micse_jax.training.momentum import self_collision_warning
from micse_jax.training.networks import Networks, SpecialTokens, compute_dtype, method_params
from micse_jax.training.precision import initial_loss_scale_state
from micse_jax.training.state import TrainState, create_train_state


@dataclasses.dataclass
class Run:
  """Everything a run needs, loaded (and validated) before anything is written to the workdir."""
  config: ml_collections.ConfigDict
  bert_config: BertConfig
  model_dir: str
  tokenizer: Tokenizer
  batches: TrainBatches
  encoder_params: dict  # the checkpoint's BERT params (with its MLM head `cls` where the method reads it)
  tokens: SpecialTokens  # the tokenizer's special token ids (the views and masks that need them)


def prepare_runs(config: ml_collections.ConfigDict, devices=None) -> list[Run]:
  """Each run of `config` prepared (`prepare`: the run, or each population member's solo config), its
  batches padded to the devices its rows are split over (`population_placement.row_devices`, as
  `program.build` pads the program's rows); validates all input (the trainer calls it before it
  writes anything)."""
  count = len(jax.devices() if devices is None else devices)
  rows_over = population_placement.row_devices(population_fields.size(config), count)
  config_checks.check_chunk_size(config.get("chunk_size", "0"),
                                 data_parallel.padded_batch_size(config.batch_size, rows_over), rows_over)
  return [prepare(c, rows_over) for c in population_fields.member_configs(config) or [config]]


def prepare(config: ml_collections.ConfigDict, row_devices: int | None = None) -> Run:
  """Loads the model and corpus; raises ConfigError / ModelLoadError / CorpusError on bad input.
  `row_devices`: the devices the run's rows are split over, whose multiple its batches are padded
  to (`population_placement.row_devices`; default every device).

  Expects a config that passed `config_checks.check_config`; runs only the checks that need the model.
  """
  model_dir = resolve_model_dir(config.model.name_or_path)
  check_against_model(config, load_config(model_dir))
  needs_head = needs_mlm_head(config)
  if needs_head:
    check_mlm_head(config, model_dir, has_mlm_head(model_dir))
  with timeline.phase("load"):
    tokenizer = Tokenizer.from_pretrained(model_dir)
  with timeline.phase("data"):  # before the weights load: a bad corpus is reported without waiting for them
    batches = build_train_batches(
        config.data.corpus, tokenizer, max_length=config.model.max_length,
        global_batch_size=config.batch_size, seed=config.seed, num_sentences=config.data.num_sentences or None,
        subset_seed=config.data.subset_seed, show_progress=jax.process_index() == 0,
        padded_batch_size=data_parallel.padded_batch_size(config.batch_size, row_devices or jax.device_count()),
        cache_dir=caches.tokenized_cache_dir(config))
  with timeline.phase("load"):
    _, encoder_params, bert_config, model_dir = load_pretrained(model_dir, add_mlm_head=needs_head)
  warning = config.momentum.enabled and self_collision_warning(
      batches.num_sentences, config.batch_size, config.momentum.queue_size, config.momentum.mask_same_sentence)
  if warning and jax.process_index() == 0:
    logging.warning(warning)
  tokens = SpecialTokens.from_tokenizer(tokenizer, bert_config.vocab_size)
  return Run(config, bert_config, model_dir, tokenizer, batches, encoder_params, tokens)


def needs_mlm_head(config) -> bool:
  """MLM and InfoCSE read BERT's MLM head (`cls.predictions.*`) from the checkpoint."""
  return bool(config.mlm.enabled or config.infocse.enabled)


def check_mlm_head(config, model_dir: str, has_head: bool) -> None:
  """MLM / InfoCSE need BERT's MLM head: from the checkpoint, or random only when asked for."""
  if needs_mlm_head(config) and not has_head and not config.model.init_mlm_head:
    user = "mlm.enabled" if config.mlm.enabled else "infocse.enabled"
    raise MethodConfigError(
        f"{user} needs an MLM head, but {model_dir} has none (no cls.predictions.* weights); use a "
        "BertForMaskedLM checkpoint or set --config.model.init_mlm_head=True for a randomly initialised head")


def check_against_model(config: ml_collections.ConfigDict, bert_config) -> None:
  """Checks that need the checkpoint's config: the AMI layers exist and are distinct."""
  from micse_jax.losses.ami import resolve_layers  # imports JAX: only when needed
  if config.ami.enabled:
    try:
      resolve_layers(config.ami.layers, bert_config.num_hidden_layers)
    except ValueError as e:
      raise ConfigError(str(e)) from e
  positions = bert_config.max_position_embeddings - getattr(bert_config, "position_offset", 0)
  if config.model.max_length > positions:
    raise ConfigError(f"model.max_length {config.model.max_length} exceeds the {positions} "
                      "positions the model has")


def initial_params(config: ml_collections.ConfigDict, nets: Networks, encoder_params: dict) -> tuple[dict, dict]:
  """(trainable, frozen) params at step 0: the checkpoint's encoder, a fresh MLP head (seeded by
  `config.seed`) and what the method adds (`networks.method_params`)."""
  bert_config = nets.online.config
  head = MLPHead(bert_config.hidden_size, bert_config.initializer_range)
  head_params = head.init(jax.random.PRNGKey(config.seed), jnp.zeros((1, bert_config.hidden_size)))["params"]
  return method_params(config, nets, encoder_params, head_params, config.seed)


def new_train_state(config: ml_collections.ConfigDict, hidden_size: int, tx, params: dict,
                    frozen: dict | None = None) -> TrainState:
  """The step-0 train state of `params` (empty queue, EMA = online encoder, initial loss scale)."""
  return create_train_state(params, tx, seed=config.seed, momentum=config.momentum.enabled,
                            queue_size=config.momentum.queue_size, dim=hidden_size,
                            frozen_params=frozen, loss_scale=initial_loss_scale_state(config),
                            compute_dtype=compute_dtype(config))


def initial_state(config: ml_collections.ConfigDict, nets: Networks, tx, encoder_params: dict) -> TrainState:
  """The step-0 train state of a run of `config` from its checkpoint's `encoder_params`, on the
  program's networks `nets` and optimizer `tx` (`Program.initial_state`)."""
  params, frozen = initial_params(config, nets, encoder_params)
  return new_train_state(config, nets.online.config.hidden_size, tx, params, frozen)
