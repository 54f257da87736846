"""The training loop: data → jitted step over the device mesh → logs, dev selection, checkpoints."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm import tqdm

from micse_jax import config_checks, workdir as workdir_lib
from micse_jax.data.pipeline import TrainBatches, build_train_batches
from micse_jax.errors import NonFiniteLossError
from micse_jax.models.bert import BertConfig
from micse_jax.models.heads import MLPHead
from micse_jax.models.loading import has_mlm_head, load_config, load_pretrained, resolve_model_dir
from micse_jax.tokenization import Tokenizer
from micse_jax.training import checkpoint, mesh as mesh_lib
from micse_jax.training.analysis import Analysis
from micse_jax.training.dev_selection import DevSelector, final_evaluation
from micse_jax.training.method_checks import check_method_config, check_mlm_head, needs_mlm_head
from micse_jax.training.method_params import method_params
from micse_jax.training.networks import SpecialTokens
from micse_jax.training.optim import learning_rate_schedule, make_optimizer
from micse_jax.training.precision import initial_loss_scale_state
from micse_jax.training.queue import self_collision_warning
from micse_jax.training.state import TrainState, create_train_state
from micse_jax.training.step import Networks, build_networks, make_train_step


@dataclasses.dataclass
class Run:
  """Everything a run needs, built (and validated) before anything is written to the workdir."""
  config: ml_collections.ConfigDict
  bert_config: BertConfig
  model_dir: str
  tokenizer: Tokenizer
  batches: TrainBatches
  nets: Networks
  initial_params: dict  # {'encoder': BERT params, 'head': MLP head params, + per method (method_params)}
  frozen_params: dict = dataclasses.field(default_factory=dict)  # never trained (InfoCSE)


def prepare(config: ml_collections.ConfigDict) -> Run:
  """Loads the model and corpus; raises ConfigError / ModelLoadError / CorpusError on bad input."""
  config_checks.check_fields(config)
  config_checks.check_combinations(config)
  check_method_config(config)  # the relatives' views/terms and their combinations
  model_dir = resolve_model_dir(config.model.name_or_path)
  config_checks.check_against_model(config, load_config(model_dir))
  if needs_mlm_head(config):
    check_mlm_head(config, model_dir, has_mlm_head(model_dir))
  _, encoder_params, bert_config, model_dir = load_pretrained(model_dir, add_mlm_head=needs_mlm_head(config))
  tokenizer = Tokenizer.from_pretrained(model_dir)
  batches = build_train_batches(
      config.data.corpus, tokenizer, max_length=config.model.max_length,
      global_batch_size=config.batch_size, seed=config.seed, num_sentences=config.data.num_sentences or None,
      subset_seed=config.data.subset_seed, show_progress=jax.process_index() == 0,
      padded_batch_size=mesh_lib.padded_batch_size(config.batch_size, jax.device_count()))
  warning = config.momentum.enabled and self_collision_warning(
      batches.num_sentences, config.batch_size, config.momentum.queue_size, config.momentum.mask_same_sentence)
  if warning and jax.process_index() == 0:
    logging.warning(warning)
  nets = build_networks(config, bert_config, SpecialTokens.from_tokenizer(tokenizer, bert_config.vocab_size))
  head = MLPHead(bert_config.hidden_size, bert_config.initializer_range)
  head_params = head.init(jax.random.PRNGKey(config.seed), jnp.zeros((1, bert_config.hidden_size)))["params"]
  params, frozen = method_params(config, nets, encoder_params, head_params, config.seed)
  return Run(config, bert_config, model_dir, tokenizer, batches, nets, params, frozen)


def initial_state(run: Run, tx) -> TrainState:
  c = run.config
  return create_train_state(run.initial_params, tx, seed=c.seed, momentum=c.momentum.enabled,
                            queue_size=c.momentum.queue_size, dim=run.bert_config.hidden_size,
                            frozen_params=run.frozen_params, loss_scale=initial_loss_scale_state(c))


def jit_train_step(run: Run, tx, mesh, state_sharding):
  step_fn = make_train_step(run.config, run.nets, tx, learning_rate_schedule(run.config), mesh)
  return jax.jit(step_fn, in_shardings=(state_sharding, mesh_lib.batch_sharded(mesh)),
                 out_shardings=(state_sharding, mesh_lib.replicated(mesh)), donate_argnums=0)


def _check_finite(metrics: dict, step: int) -> dict:
  host = {k: float(v) for k, v in jax.device_get(metrics).items()}
  if not math.isfinite(host["loss"]) and not host.get("step_skipped"):  # fp16 overflow: skipped
    raise NonFiniteLossError(f"non-finite loss {host['loss']} at step {step}; stopped, "
                             "the last saved checkpoint is intact (lower optim.learning_rate?)")
  return host


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (resuming from `workdir` when it holds checkpoints); returns the final results."""
  config_checks.check_run(config, workdir)  # ranges, SentEval, workdir, resume compatibility
  run = prepare(config)  # all input validation happens before the workdir is touched
  mesh = mesh_lib.data_mesh()
  tx = make_optimizer(config)
  abstract_state = jax.eval_shape(lambda: initial_state(run, tx))
  state_sharding = jax.tree.map(lambda _: mesh_lib.replicated(mesh), abstract_state)
  os.makedirs(workdir, exist_ok=True)
  rolling = checkpoint.rolling_manager(workdir, config.keep_checkpoints)
  if rolling.latest_step() is not None:
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            abstract_state, state_sharding)
    state = checkpoint.resume(rolling, abstract)  # any topology; skips an unreadable latest step
    logging.info("resumed from step %d", int(state.step))
  else:
    state = jax.device_put(initial_state(run, tx), state_sharding)
  if jax.process_index() == 0:
    workdir_lib.write_run_config(workdir, {**config.to_dict(), "model_dir": run.model_dir,
                                          "bert_config": run.bert_config.to_dict()})
  train_step = jit_train_step(run, tx, mesh, state_sharding)
  selector = DevSelector(run, workdir)
  analysis = Analysis.create(run)
  writer = _summary_writer(workdir)
  try:
    state = _loop(run, state, train_step, mesh, rolling, selector, writer, analysis)
  finally:
    rolling.wait_until_finished()
    selector.manager.wait_until_finished()
    if writer:
      writer.close()
  return final_evaluation(run, workdir, state, selector)


def _loop(run: Run, state, train_step, mesh, rolling, selector, writer, analysis=None):
  c = run.config
  start = int(state.step)
  bar = tqdm(range(start, c.num_train_steps), initial=start, total=c.num_train_steps,
             disable=jax.process_index() != 0, desc="train")
  pending, tick = None, time.perf_counter()
  for step in bar:
    state, metrics = train_step(state, mesh_lib.global_batch(run.batches.batch(step), mesh))
    if pending is not None:
      _check_finite(pending, step - 1)  # one step behind: the device keeps working meanwhile
    pending, done = metrics, step + 1
    last = done == c.num_train_steps
    log, evaluate = done % c.log_every == 0 or last, selector.enabled and (done % c.eval_every == 0 or last)
    save = done % c.checkpoint_every == 0 or last
    if log or evaluate or save:  # never log, select or save a non-finite state
      host, pending = _check_finite(metrics, done), None
    if log:
      now = time.perf_counter()
      host["steps_per_sec"] = c.log_every / max(now - tick, 1e-9)
      tick = now
      bar.set_postfix({k: f"{host[k]:.4g}" for k in ("loss", "infonce", "positive_only", "ami_mi") if k in host})
      _write_scalars(writer, done, host)
    if evaluate:
      scores = selector(state)
      _write_scalars(writer, done, scores)
      bar.write(f"step {done}: " + ", ".join(f"{k} {v:.2f}" for k, v in scores.items()))
    if analysis is not None and c.eval_every > 0 and (done % c.eval_every == 0 or last):
      stats = analysis(state)  # alignment, uniformity, attention MI on the held-out slice
      _write_scalars(writer, done, stats)
      bar.write(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in stats.items()))
    if save:
      checkpoint.save_state(rolling, state)
  return state


def _summary_writer(workdir: str):
  if jax.process_index() != 0:
    return None
  from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  return SummaryWriter(os.path.join(workdir, "tensorboard"))


def _write_scalars(writer, step: int, scalars: dict) -> None:
  if writer is None:
    return
  for k, v in scalars.items():
    tag = k if "/" in k else f"train/{k}" if "dev" not in k else f"eval/{k}"
    writer.add_scalar(tag, float(np.asarray(v)), step)
  writer.flush()
