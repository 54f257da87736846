"""The one program (`training/program.py`): the deviceless compile (`aot/compile.py`) lowers exactly
the step the trainer runs, for a solo run and a population; a solo run's program is the solo step;
the step is jitted in one place."""
import ast
import os

import jax
import numpy as np
import pytest

from micse_jax.aot import compile as aot_compile
from micse_jax.configs import population_fields
from micse_jax.training import program, trainer
from tests.train_utils import tiny_training_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@pytest.mark.parametrize("fields", [{}, {"seeds": (1, 2), "learning_rates": (1e-3, 2e-3)}], ids=["solo", "population"])
def test_the_deviceless_compile_lowers_the_program_the_trainer_runs(tmp_path, minilm_dir, monkeypatch, fields):
  config = tiny_training_config(tmp_path, minilm_dir, num_train_steps=1, checkpoint_every=1)
  for key, value in fields.items():
    config.population[key] = value
  ran = _trainer_program(config, str(tmp_path / "wd"), monkeypatch)
  trainer_text = ran.lower().as_text()
  assert trainer_text == _deviceless_text(config)
  assert ("population_step" in trainer_text) == bool(fields)  # the module is jit_<step>


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


def _calls(name: str, roots=("micse_jax",)) -> list[tuple[str, str]]:
  """(file, enclosing function) of every call of `name` (`f(...)` or `x.f(...)`) in the files under `roots`."""
  found = []
  for root in roots:
    for folder, _, files in os.walk(os.path.join(REPO, root)):
      for file in sorted(f for f in files if f.endswith(".py")):
        path = os.path.join(folder, file)
        with open(path, encoding="utf-8") as f:
          tree = ast.parse(f.read())
        for function in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
          for node in ast.walk(function):
            called = node.func if isinstance(node, ast.Call) else None
            if getattr(called, "attr", getattr(called, "id", None)) == name:
              found.append((os.path.relpath(path, REPO), function.name))
  return sorted(set(found))


def test_the_step_is_built_and_jitted_in_one_place():
  """The pure train step is built only by the program, which jits it once, in the library and in the
  tests (which take their steps from it: `tests/train_utils.program_steps`); every other `jax.jit` of
  the library jits something else (evaluation, init, the non-finite flag, a layout conversion); the
  networks are built by the program alone."""
  everywhere = ("micse_jax", "tests")
  assert _calls("make_train_step", everywhere) == [("micse_jax/training/program.py", "_jitted_step")]
  assert _calls("make_population_step", everywhere) == [("micse_jax/training/program.py", "_jitted_step")]
  assert _calls("member_step_fn", everywhere) == [("micse_jax/training/population.py", "make_population_step")]
  jits = _calls("jit")
  assert [j for j in jits if j[0] == "micse_jax/training/program.py"] == [
      ("micse_jax/training/program.py", "_jitted_step")]
  assert not [path for path, _ in jits if path.startswith(("micse_jax/bench", "micse_jax/aot", "micse_jax/studies"))]
  assert _calls("build_networks") == [("micse_jax/training/networks.py", "build_networks"),  # InfoCSE's own
                                      ("micse_jax/training/program.py", "build")]
