"""A population's workdir says only what is true: a half-precision checkpoint holds no weight copies
and resumes to the uninterrupted run (also from the older layout that saved them); a stopped member
is reported once, recorded in its folder and named by the run summary in the same words, and refused
by micse-convert / micse-evaluate / micse-analyze however it is named (`--member i` or its folder) unless asked; the
population workdir itself is named as such, with the `--member` values it has; a member field given
on the command line that the population replaces is one error line; a run whose every member
diverged before its first save does not claim a checkpoint."""
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from micse_jax import config_checks, convert, jsonio
from micse_jax import workdir as workdir_lib
from micse_jax.configs import population_fields
from micse_jax.encoder import SentenceEncoder, load_encoder
from micse_jax.errors import CheckpointError, ConfigError, NonFiniteLossError
from micse_jax.evaluation import command as evaluate
from micse_jax.training import checkpoint, program, run_inputs, trainer
from tests.helpers import run_module
from tests.train_utils import tiny_training_config, train_preempted_after_first_save

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _population(tmp_path, minilm_dir, steps, **fields):
  config = tiny_training_config(tmp_path, minilm_dir, num_train_steps=steps)
  for key, value in fields.items():
    config.population[key] = value
  return config


def _saved_members(workdir: str, step: int) -> dict:
  """The members' saved tree at `step`, read by key path (no abstract state of the library's)."""
  return workdir_lib.read_subtree(os.path.join(workdir, workdir_lib.ROLLING_DIR), step, "members")


def _saved_layout(workdir: str, step: int) -> set:
  reader = workdir_lib.step_reader(os.path.join(workdir, workdir_lib.ROLLING_DIR))
  try:
    return checkpoint.state_layout(reader.item_metadata(step).tree)
  finally:
    reader.close()


def _assert_equal_trees(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _bf16_population(tmp_path, minilm_dir):
  config = _population(tmp_path, minilm_dir, 4, seeds=(1, 2))
  config.model.dtype, config.checkpoint_every = "bfloat16", 2
  return config


@pytest.mark.slow  # ~40 s: the bf16 copies left out of checkpoints are tested solo in the default run
def test_a_bfloat16_population_checkpoint_holds_no_copies_and_resumes_to_the_uninterrupted_run(
    tmp_path, minilm_dir, monkeypatch):
  config = _bf16_population(tmp_path, minilm_dir)
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  trainer.train_and_evaluate(config, straight)
  train_preempted_after_first_save(trainer, checkpoint, monkeypatch, config, resumed)
  trainer.train_and_evaluate(config, resumed)
  for workdir in (straight, resumed):
    for step in (2, 4):
      layout = _saved_layout(workdir, step)
      assert any(k.startswith("members/params/encoder/") and k.endswith("kernel") for k in layout)
      assert not [k for k in layout if "compute_weights" in k]  # the copies are derived: never saved
  _assert_equal_trees(_saved_members(straight, 4), _saved_members(resumed, 4))


@pytest.mark.slow  # a third and fourth bfloat16 population run (~30 s each on the shared CPU)
@pytest.mark.parametrize("copies_saved", [False, True])
def test_a_population_checkpoint_of_an_older_layout_resumes_converted(tmp_path, minilm_dir, monkeypatch, caplog,
                                                                      copies_saved):
  """The layouts earlier releases wrote — every member's optimizer state flat (the previous release),
  and also every member's half-precision copies (releases before it) — written here by hand, are
  converted on resume, to the uninterrupted run bit for bit."""
  from tests.train_utils import in_flat_layout, rewrite_rolling
  config = _bf16_population(tmp_path, minilm_dir)
  straight, old = str(tmp_path / "straight"), str(tmp_path / "old")
  trainer.train_and_evaluate(config, straight)
  train_preempted_after_first_save(trainer, checkpoint, monkeypatch, config, old)
  abstract = program.of_runs(config, run_inputs.prepare_runs(config)).abstract_state
  state = checkpoint.restore_state(workdir_lib.rolling_manager(old, 2), abstract, step=2)
  assert state.members.compute_weights["encoder"]  # rebuilt on restore
  members = state.members.replace(opt_state=in_flat_layout(jax.device_get(state.members.opt_state), members=True))
  if copies_saved:
    members = members.replace(compute_weights={k: state.members.compute_weights[k] for k in ("encoder", "ema")})
  else:
    members = members.replace(compute_weights={})
  rewrite_rolling(old, state.replace(members=members))
  layout = _saved_layout(old, 2)
  assert bool([k for k in layout if "compute_weights" in k]) == copies_saved
  assert "members/opt_state/inner_state/1/0/mu" in layout
  trainer.train_and_evaluate(config, old)
  assert "older release's layout" in caplog.text
  _assert_equal_trees(_saved_members(straight, 4), _saved_members(old, 4))


@pytest.fixture(scope="module")
def stopped_population(tmp_path_factory, minilm_dir):
  """A population of 2 trained by `micse-train` (4 steps, a checkpoint per step) whose member 1
  (learning rate 1e12, no clipping) stops: (workdir, the step it stopped at, the run's output)."""
  from tests.startup_cost_test import _train_command
  root = tmp_path_factory.mktemp("stopped_population")
  config = tiny_training_config(root, minilm_dir)
  workdir = str(root / "pop")
  command = [*_train_command(config, workdir)[2:], "--config.population.seeds=(1,2)",
             "--config.population.learning_rates=(1e-3,1e12)", "--config.optim.grad_clip_norm=0.0",
             "--config.optim.warmup_steps=0", "--config.checkpoint_every=1", "--config.num_train_steps=4"]
  done = run_module(*command, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  stopped = workdir_lib.member_stopped(workdir_lib.member_dir(workdir, 1))
  assert stopped is not None and 0 <= stopped < 4
  assert workdir_lib.member_stopped(workdir_lib.member_dir(workdir, 0)) is None
  return workdir, stopped, done


def test_a_stopped_member_is_reported_once_and_in_the_same_words_everywhere(stopped_population):
  workdir, stopped, done = stopped_population
  reports = [line for line in (done.stdout + done.stderr).replace("\r", "\n").splitlines()
             if "population member 1 (seed 2) stopped" in line]
  assert len(reports) == 1, done.stdout + done.stderr
  said = "its state is kept as before that step"
  assert f"at step {stopped}; {said}, 1 member(s) go on" in reports[0]
  record = jsonio.read_json(os.path.join(workdir_lib.member_dir(workdir, 1), workdir_lib.STOPPED_FILE))
  assert record["stopped_at_step"] == stopped and said in record["reason"]
  (summary,) = [line for line in done.stdout.splitlines() if line.strip().startswith("member 1 (seed 2)")]
  assert f"STOPPED at step {stopped} (a non-finite update; {said})" in summary and "--allow_stopped" in summary


@pytest.mark.parametrize("command", [
    ["micse_jax.convert", "--workdir", "{member}", "--output", "{out}"],
    ["micse_jax.convert", "--workdir", "{workdir}", "--member", "1", "--output", "{out}"],
    ["micse_jax.evaluate", "--model", "{member}", "--tasks", "STSBenchmark", "--output", "{out}"],
    ["micse_jax.evaluate", "--model", "{workdir}", "--member", "1", "--tasks", "STSBenchmark", "--output", "{out}"],
    ["micse_jax.analyze", "--model", "{workdir}", "--member", "1", "--output", "{out}"],
], ids=["convert-folder", "convert-member", "evaluate-folder", "evaluate-member", "analyze-member"])
def test_a_stopped_member_is_refused_however_it_is_named(stopped_population, tmp_path, command):
  workdir, stopped, _ = stopped_population
  names = {"member": workdir_lib.member_dir(workdir, 1), "workdir": workdir, "out": str(tmp_path / "out")}
  done = run_module(*[part.format(**names) for part in command])
  assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
  assert done.stderr.splitlines() == [done.stderr.strip()] and done.stderr.startswith("error: member 1 of ")
  assert f"stopped at step {stopped}" in done.stderr and "--allow_stopped" in done.stderr
  assert not os.path.exists(names["out"])  # nothing written


@pytest.mark.parametrize("command", [
    ["micse_jax.convert", "--workdir", "{workdir}", "--output", "{out}"],
    ["micse_jax.evaluate", "--model", "{workdir}", "--tasks", "STSBenchmark", "--output", "{out}"],
    ["micse_jax.analyze", "--model", "{workdir}", "--output", "{out}"],
], ids=["convert", "evaluate", "analyze"])
def test_a_population_workdir_without_member_is_named_with_its_members(stopped_population, tmp_path, command):
  workdir, _, _ = stopped_population
  done = run_module(*[part.format(workdir=workdir, out=str(tmp_path / "out")) for part in command])
  assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
  assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
  assert f"{workdir} is a population workdir (2 members" in done.stderr and "--member 0 or 1" in done.stderr
  assert "unreadable" not in done.stderr and not os.path.exists(tmp_path / "out")


def test_a_stopped_member_folder_exports_when_asked_and_a_population_is_no_one_encoder(stopped_population, tmp_path):
  workdir, stopped, _ = stopped_population
  done = run_module("micse_jax.convert", "--workdir", workdir_lib.member_dir(workdir, 1), "--allow_stopped",
                  "--output", str(tmp_path / "export1"))
  assert done.returncode == 0, done.stderr
  assert f"member 1 stopped at step {stopped}" in done.stdout and os.path.isfile(tmp_path / "export1" / "config.json")
  with pytest.raises(CheckpointError, match=r"population workdir \(2 members.*--member 0 or 1"):
    load_encoder(workdir)
  with pytest.raises(CheckpointError, match=f"stopped at step {stopped}"):
    load_encoder(workdir_lib.member_dir(workdir, 1))


def test_a_workdir_loads_with_from_pretrained_and_without_orbax_notices(stopped_population):
  """`SentenceEncoder.from_pretrained(workdir)` is `load_encoder`'s encoder: the workdir's trained
  params (member 0's slice of the population's latest checkpoint, read here by key path) and head;
  loading prints nothing (Orbax warned three times that its read-only managers are read-only)."""
  workdir, _, _ = stopped_population
  folder = workdir_lib.member_dir(workdir, 0)
  encoder = SentenceEncoder.from_pretrained(folder)
  step = workdir_lib.rolling_manager(workdir, 2, read_only=True).latest_step()
  saved = workdir_lib.read_subtree(os.path.join(workdir, workdir_lib.ROLLING_DIR), step, "members/params")
  _assert_equal_trees(encoder.params, jax.tree.map(lambda x: x[0], saved["encoder"]))
  _assert_equal_trees(encoder.head_params, jax.tree.map(lambda x: x[0], saved["head"]))
  done = subprocess.run([sys.executable, "-c", f"from micse_jax.encoder import load_encoder; load_encoder({folder!r})"],
                        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr


def test_a_stopped_member_is_recorded_refused_and_named(stopped_population, tmp_path, capsys):
  workdir, stopped, _ = stopped_population
  with pytest.raises(convert.ConvertError, match=f"member 1 of .* stopped at step {stopped}") as error:
    convert.convert(output=str(tmp_path / "export1"), workdir=workdir, member=1)
  assert "\n" not in str(error.value) and "--allow_stopped" in str(error.value)
  assert not os.path.exists(tmp_path / "export1")  # nothing written
  with pytest.raises(CheckpointError, match="stopped at step"):
    evaluate._model_path(SimpleNamespace(model=workdir, member=1))
  capsys.readouterr()
  convert.convert(output=str(tmp_path / "export1"), workdir=workdir, member=1, allow_stopped=True)
  assert f"member 1 stopped at step {stopped}" in capsys.readouterr().out
  convert.convert(output=str(tmp_path / "export0"), workdir=workdir, member=0)  # a healthy member as before
  lines = workdir_lib.population_summary(workdir)
  assert f"STOPPED at step {stopped}" in lines[1] and "--allow_stopped" in lines[1]
  assert "STOPPED" not in lines[0] and "--allow_stopped" not in lines[0]


@pytest.mark.parametrize("fields", [{"seeds": (1, 2), "learning_rates": (1e12, 1e12)}, {}], ids=["population", "solo"])
def test_a_run_that_diverges_before_its_first_save_claims_no_checkpoint(tmp_path, minilm_dir, fields):
  config = _population(tmp_path, minilm_dir, 4, **fields)
  config.optim.grad_clip_norm, config.optim.warmup_steps, config.checkpoint_every = 0.0, 0, 10
  if not fields:
    config.optim.learning_rate = 1e12
  with pytest.raises(NonFiniteLossError) as error:
    trainer.train_and_evaluate(config, str(tmp_path / "wd"))
  message = str(error.value)
  assert "\n" not in message and "intact" not in message and "before any checkpoint was saved" in message
  assert ("every population member" in message) == bool(fields)
  assert workdir_lib.rolling_manager(str(tmp_path / "wd"), 2).latest_step() is None


@pytest.mark.parametrize("name", sorted(population_fields.PER_MEMBER))
def test_a_member_field_the_population_replaces_is_refused_on_the_command_line(tmp_path, minilm_dir, name):
  config = _population(tmp_path, minilm_dir, 4, seeds=(1, 2))
  spec = population_fields.PER_MEMBER[name]
  if name != "seeds":
    config.population[name] = (1, 1) if spec.per_member else 8
  with pytest.raises(ConfigError, match=rf"--config\.{spec.field} is replaced in every member by population\.{name}"):
    config_checks.check_command_line(config, {spec.field, "batch_size"})
  config_checks.check_command_line(config, {"batch_size", "population.seeds"})  # nothing it replaces
  config.population.seeds = ()
  config.population[name] = () if spec.per_member else 0
  config_checks.check_command_line(config, {spec.field})  # a solo run: the field is the run's


def test_micse_train_refuses_seed_beside_population_seeds_in_one_line(tmp_path):
  workdir = tmp_path / "wd"
  out = subprocess.run([sys.executable, "-m", "micse_jax.main", "--config", "micse:demo",
                        "--config.population.seeds=(1,)", "--config.seed=7", f"--workdir={workdir}"],
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 1
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "--config.seed is replaced in every member by population.seeds" in errors[0]
  assert not workdir.exists()  # nothing written
