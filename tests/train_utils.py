"""Small training set-ups for tests: a tiny random BERT on disk and a short corpus."""
import os

from tests.helpers import write_tiny_hf_checkpoint


def tiny_training_config(tmp_path, tokenizer_dir, variant="micse", **overrides):
  """miCSE config on a 2-layer hidden-64 random BERT and a 96-sentence corpus; eval off."""
  import importlib
  model_dir = str(tmp_path / "tiny_model")
  if not os.path.isdir(model_dir):
    write_tiny_hf_checkpoint(model_dir, tokenizer_dir, mlm=False, num_attention_heads=4)
  corpus = tmp_path / "corpus.txt"
  if not corpus.exists():
    corpus.write_text("\n".join(f"sentence number {i} talks about topic {i % 7} and more {i * 3}"
                                for i in range(96)) + "\n", encoding="utf-8")
  config = importlib.import_module(f"micse_jax.configs.{variant}").get_config()
  config.model.name_or_path = model_dir
  config.model.max_length = 16
  config.data.corpus = str(corpus)
  config.batch_size = 8
  config.num_train_steps = 4
  config.optim.warmup_steps = 2
  config.optim.learning_rate = 1e-3
  config.momentum.queue_size = 12
  config.ami.layers = (0, 1)
  config.ami.num_samples = 20
  config.eval_every = 0
  config.eval.final_tasks = ""
  config.log_every = 1
  config.checkpoint_every = 2
  for key, value in overrides.items():
    set_dotted(config, key, value)
  return config


def set_dotted(config, key: str, value) -> None:
  """config['a']['b'] = value for key 'a.b'."""
  node = config
  *parents, leaf = key.split(".")
  for p in parents:
    node = node[p]
  node[leaf] = value



def train_preempted_after_first_save(trainer, checkpoint, monkeypatch, config, workdir) -> None:
  """Runs training until its first checkpoint is committed, then stops it (a simulated preemption)."""
  import pytest
  real_save = checkpoint.save_state

  def save_then_preempt(manager, state, metrics=None):
    real_save(manager, state, metrics)
    manager.wait_until_finished()
    raise KeyboardInterrupt("simulated preemption")

  monkeypatch.setattr(checkpoint, "save_state", save_then_preempt)
  with pytest.raises(KeyboardInterrupt):
    trainer.train_and_evaluate(config, workdir)
  monkeypatch.setattr(checkpoint, "save_state", real_save)


def rewrite_in_old_layout(workdir: str, state) -> None:
  """Replaces `workdir`'s rolling checkpoints by `state` saved as releases before the `Queue`
  struct laid it out (written here by hand, independently of the library's conversion): a dict of
  the fields with the queue as four loose entries."""
  fields = {k: getattr(state, k) for k in ("step", "params", "ema_params", "opt_state", "rng", "loss_scale",
                                          "frozen_params")}
  q = state.queue
  rewrite_rolling(workdir, dict(fields, queue=q.embeddings, queue_valid=q.valid, queue_ptr=q.ptr, queue_ids=q.ids))


def rewrite_rolling(workdir: str, tree) -> None:
  """Replaces `workdir`'s rolling checkpoints by `tree` saved as it is, at `tree`'s step."""
  import shutil

  import orbax.checkpoint as ocp

  from micse_jax import workdir as workdir_lib
  step = tree["step"] if isinstance(tree, dict) else tree.step
  rolling = os.path.join(workdir, workdir_lib.ROLLING_DIR)
  for name in os.listdir(rolling):
    if name.isdigit():
      shutil.rmtree(os.path.join(rolling, name))
  manager = workdir_lib.rolling_manager(workdir, 2)
  manager.save(int(step), args=ocp.args.PyTreeSave(tree))
  manager.wait_until_finished()


def in_flat_layout(opt_state, members: bool = False):
  """An optimizer state as the previous release laid it out (written here by hand, independently of
  the library's conversion): `FlatState` around the chain's state, each moment tree (a dict) raveled
  in tree order into one float32 vector, zero-padded to a multiple of 4096; `members`: stacked
  population members (a leading axis kept)."""
  import jax
  import numpy as np

  from micse_jax.training.legacy_checkpoints import FlatState

  def flat(tree):
    leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
    rows = [np.concatenate([x[i].ravel() for x in leaves]) for i in range(leaves[0].shape[0])] if members \
        else [np.concatenate([x.ravel() for x in leaves])]
    pad = -(-rows[0].size // 4096) * 4096 - rows[0].size
    padded = np.stack([np.concatenate([r, np.zeros(pad, np.float32)]) for r in rows])
    return padded if members else padded[0]

  def walk(node):
    if isinstance(node, dict):
      return flat(node)
    if isinstance(node, tuple):
      parts = [walk(n) for n in node]
      return type(node)(*parts) if hasattr(node, "_fields") else tuple(parts)
    return node
  return FlatState(walk(opt_state))


def prepared_program(config, devices=None):
  """(program, runs) as the trainer builds them: each run prepared (`run_inputs.prepare`: the run, or each
  population member), the program of `config` on them (`program.of_runs`, on `devices`)."""
  from micse_jax.training import program, run_inputs
  runs = run_inputs.prepare_runs(config, devices)
  return program.of_runs(config, runs, devices), runs


def initial_params(prog, run) -> tuple:
  """A run's step-0 (params, frozen params) on the program's networks, as the trainer starts it."""
  from micse_jax.training import run_inputs
  return run_inputs.initial_params(run.config, prog.nets, run.encoder_params)


def program_steps(config, steps: int, devices=None):
  """(step-0 state, final state, per-step metrics), on the host, of `steps` steps of the trainer's
  program (`training/program.py`: its networks, placements, packed batches and donated step, compiled
  as the trainer compiles it, `program.compiled`, through the compilation cache the trainer opens, so a
  program another test or run compiled is read back), each step on the batch of its data position."""
  from micse_jax import caches
  caches.enable_compilation_cache(config)
  return steps_of(*prepared_program(config, devices), steps)


def steps_of(prog, runs, steps: int):
  """`program_steps` on a prepared program (compiled here unless it is) and its runs (`prepared_program`)."""
  import jax

  from micse_jax.training import program
  prog = prog if prog.executable is not None else program.compiled(prog)
  state = prog.initial_state(runs)
  init, history = jax.device_get(state), []
  for position in range(steps):
    state, metrics, _ = prog.run(state, prog.place_batch([r.batches.batch(position) for r in runs]))
    history.append(jax.device_get(metrics))
  return init, jax.device_get(state), history


def step0_shapes(config, sharding=None):
  """The step-0 train state's shapes as the trainer's program places them (`Program.abstract_state`),
  or every leaf on `sharding`: the target a test restores a workdir's checkpoint onto."""
  import jax
  abstract = prepared_program(config)[0].abstract_state
  if sharding is None:
    return abstract
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract)



def restore_latest(config, workdir, sharding=None):
  """The workdir's latest (rolling) checkpoint restored onto `step0_shapes(config, sharding)`."""
  from micse_jax import workdir as workdir_lib
  from micse_jax.training import checkpoint
  return checkpoint.restore_state(workdir_lib.rolling_manager(workdir, 2), step0_shapes(config, sharding))


def set_up_calls(config, workdir: str, counted) -> list[str]:
  """The modules (`__name__`) of the calls `counted(frame)` admits that `trainer.train_and_evaluate`
  makes until its loop starts, in call order (the run then goes on to its end unwatched)."""
  import sys

  from micse_jax.training import trainer
  calls, on, loop = [], [True], trainer._train.__code__

  def profile(frame, event, arg):
    if event != "call" or not on[0]:
      return
    if frame.f_code is loop:
      on[0] = False
    elif counted(frame):
      calls.append(frame.f_globals.get("__name__", ""))

  sys.setprofile(profile)
  try:
    trainer.train_and_evaluate(config, workdir)
  finally:
    sys.setprofile(None)
  return calls
