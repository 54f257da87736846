"""The one program (`training/program.py`): the deviceless compile (`aot/compile.py`) lowers exactly
the step the trainer runs, for a solo run and a population; a solo run's program is the solo step;
the step is jitted in one place."""
import sys

import jax
import numpy as np
import pytest

from micse_jax.aot import compile as aot_compile
from micse_jax.configs import population_fields
from micse_jax.training import networks, population, program, step, trainer
from tests.train_utils import tiny_training_config


def _trainer_program(config, workdir, monkeypatch) -> program.Program:
  """The program `trainer.train_and_evaluate` builds and runs (one step)."""
  built = []
  of_runs = program.of_runs

  def spy(*args, **kwargs):
    built.append(of_runs(*args, **kwargs))
    return built[-1]
  monkeypatch.setattr(program, "of_runs", spy)
  trainer.train_and_evaluate(config, workdir)
  assert len(built) == 1
  return built[0]


def _deviceless_text(config) -> str:
  """What the deviceless compile lowers for `config` on this machine's devices: from the model's
  config file and tokenizer alone, as `micse-sweep --population_size auto` calls it."""
  from micse_jax.models.loading import load_config
  from micse_jax.tokenization import Tokenizer
  from micse_jax.training.networks import SpecialTokens
  bert_config = load_config(config.model.name_or_path)
  tokens = SpecialTokens.from_tokenizer(Tokenizer.from_pretrained(config.model.name_or_path), bert_config.vocab_size)
  return aot_compile.lower_program(config, bert_config, jax.devices(), tokens).as_text()


class _BuildWatch:
  """Who builds the networks and the pure train step, and who jits the training call, while it watches:
  the callers (module, function) of `build_networks`, `make_train_step` and `make_population_step`
  (seen by the profiler, however they were imported), and of each `jax.jit` of a training call."""

  BUILDERS = {networks.build_networks.__code__: "build_networks", step.make_train_step.__code__: "make_train_step",
              population.make_population_step.__code__: "make_population_step"}

  def __init__(self, monkeypatch):
    self.built: list[tuple[str, str, str]] = []
    self.jitted: list[tuple[str, str]] = []
    jit = jax.jit

    def watched_jit(fun, *args, **kwargs):
      if getattr(fun, "__name__", "") in ("train_steps", "population_steps"):
        caller = sys._getframe(1)
        self.jitted.append((caller.f_globals["__name__"], caller.f_code.co_name))
      return jit(fun, *args, **kwargs)
    monkeypatch.setattr(jax, "jit", watched_jit)

  def __enter__(self):
    def profile(frame, event, arg):
      name = self.BUILDERS.get(frame.f_code) if event == "call" else None
      if name:
        self.built.append((name, frame.f_back.f_globals["__name__"], frame.f_back.f_code.co_name))
    sys.setprofile(profile)
    return self

  def __exit__(self, *exc):
    sys.setprofile(None)


# The tiny run as it is (solo), and a population of two without warm-up or clipping: programs that other
# tests' runs compile too (the trainer reads them from the compilation cache where one did).
@pytest.mark.parametrize("fields", [{}, {"seeds": (1, 2), "learning_rates": (1e-3, 2e-3)}], ids=["solo", "population"])
def test_the_deviceless_compile_lowers_the_program_the_trainer_runs(tmp_path, minilm_dir, monkeypatch, fields):
  """The trainer and the deviceless compile lower the same program, whose step and networks are built
  by `program.build` alone and jitted once per build, by `program._jitted_step` alone."""
  config = tiny_training_config(tmp_path, minilm_dir)
  for key, value in fields.items():
    config.population[key] = value
  if fields:
    config.optim.grad_clip_norm, config.optim.warmup_steps = 0.0, 0
  with _BuildWatch(monkeypatch) as watch:
    ran = _trainer_program(config, str(tmp_path / "wd"), monkeypatch)
    deviceless = _deviceless_text(config)
  trainer_text = ran.lower().as_text()
  assert trainer_text == deviceless
  assert ("population_step" in trainer_text) == bool(fields)  # the module is jit_<step>
  builds = [b for b in watch.built if b[0] == "build_networks"]
  assert builds and set(builds) == {("build_networks", "micse_jax.training.program", "build")}
  steps = [b for b in watch.built if b[0] != "build_networks"]
  step_builder = "make_population_step" if fields else "make_train_step"
  assert {b[0] for b in steps} >= {step_builder}
  assert {b[1:] for b in steps if b[0] == step_builder} == {("micse_jax.training.program", "_jitted_step")}
  assert set(watch.jitted) == {("micse_jax.training.program", "_jitted_step")}
  assert len(watch.jitted) == len(builds)  # one jit of the training call per program built


def test_a_solo_program_is_the_solo_step_and_a_population_one_is_vmapped(tmp_path, minilm_dir):
  """A solo run's state has no member axis and its step no step inputs; a population's stacks K
  members and takes one array per per-member hyper-parameter."""
  from micse_jax.models.loading import load_config
  config = tiny_training_config(tmp_path, minilm_dir)
  bert_config = load_config(config.model.name_or_path)
  encoder = program.abstract_encoder(config, bert_config)
  solo = program.build(config, bert_config, encoder)
  kernel = lambda state: state.params["encoder"]["embeddings"]["word_embeddings"]["embedding"].shape
  assert solo.members == 0 and solo.hyper == {}
  assert kernel(solo.abstract_state) == (bert_config.vocab_size, bert_config.hidden_size)  # no member axis
  args = solo.inputs("state", "batch")  # a solo call's third argument: its non-finite watch
  assert len(args) == 3 and int(args[2].first_bad) == -1
  config.population.seeds, config.population.ami_weights = (3, 4, 5), (0.0, 0.1, 0.2)
  pop = program.build(config, bert_config, encoder)
  assert pop.members == 3 and kernel(pop.abstract_state.members) == (3, *kernel(solo.abstract_state))
  np.testing.assert_array_equal(pop.hyper["ami_weight"], np.float32([0.0, 0.1, 0.2]))
  assert set(pop.hyper) == {population_fields.PER_MEMBER["ami_weights"].step_input}


