"""The CLIs' shared rules: bad input is one line, a bug keeps its traceback, start-up is quiet
(whatever plugins are installed where no accelerator is), `--help` exits 0, a repeated override
replaces the earlier one (every field alike), a run ends with a summary; and the config checks
that need no model."""
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from micse_jax import cli, config_checks, errors, resume_checks
from micse_jax import workdir as workdir_lib
from tests.helpers import REPO, run_module
from tests.train_utils import set_dotted


def test_a_bug_deep_in_training_keeps_its_traceback(monkeypatch, tmp_path):
  """`main` used to turn any KeyError/ValueError into 'invalid --config override'."""
  from micse_jax import main
  from micse_jax.training import trainer

  def buggy(config, workdir):
    raise KeyError("a bug, not a user mistake")
  monkeypatch.setattr(trainer, "train_and_evaluate", buggy)
  with pytest.raises(KeyError, match="a bug"):
    main.train(None, str(tmp_path))


@pytest.mark.parametrize("error", [ValueError("bug"), TypeError("bug"), OSError("bug")])
def test_only_micse_errors_become_one_line(error, capsys):
  with pytest.raises(type(error)):
    with cli.input_errors_as_one_line():
      raise error
  with pytest.raises(SystemExit) as e:
    with cli.input_errors_as_one_line():
      raise errors.CorpusError("corpus file is empty: x.txt\nsecond line")
  assert e.value.code == 1
  assert capsys.readouterr().err == "error: corpus file is empty: x.txt\n"


def test_flag_error_lines():
  wrapped = AttributeError(KeyError("'batch_sise'\nDid you mean \"batch_size\" instead of \"batch_sise\"?"))
  assert cli.flag_error_line(wrapped) == ("unknown field 'batch_sise'; Did you mean \"batch_size\" "
                                          "instead of \"batch_sise\"?")
  parse_error = ValueError("flag --config=c.py:x: Error whilst parsing config file:\n\nTraceback "
                           "(most recent call last):\n  File \"c.py\", line 3\nValueError: unknown variant 'x'")
  assert cli.flag_error_line(parse_error) == ("flag --config=c.py:x: Error whilst parsing config file: "
                                              "ValueError: unknown variant 'x'")


def test_quiet_startup_hides_tpu_probe_and_pytorch_notice(monkeypatch, capfd):
  monkeypatch.delenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", raising=False)
  jax_logger = logging.getLogger("jax._src.xla_bridge")
  previous = jax_logger.level
  jax_logger.setLevel(logging.INFO)  # setLevel, not assignment: it clears the logger's cache
  assert jax_logger.isEnabledFor(logging.INFO)  # the "Unable to initialize backend 'tpu'" level
  try:
    cli.quiet_startup()
  finally:
    enabled = jax_logger.isEnabledFor(logging.INFO), jax_logger.isEnabledFor(logging.WARNING)
    jax_logger.setLevel(previous)
  assert enabled == (False, True)
  orbax_file = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "checkpoint_manager.py")
  record = lambda level, path: logging.LogRecord("absl", level, path, 1, "msg", None, None)
  absl_logger = logging.getLogger("absl")
  assert not absl_logger.filter(record(logging.WARNING, orbax_file))  # "read_only=True, ..."
  assert absl_logger.filter(record(logging.ERROR, orbax_file))
  assert absl_logger.filter(record(logging.WARNING, os.path.join(os.sep, "micse_jax", "x.py")))
  from transformers.utils import logging as hf_logging
  capfd.readouterr()
  hf_logging.get_logger("transformers").warning_advice("PyTorch was not found. Models won't be available")
  assert "PyTorch was not found" not in capfd.readouterr().err


def test_run_summary_names_best_score_paths_and_export(tmp_path):
  from micse_jax.training import checkpoint
  wd = str(tmp_path / "run")
  os.makedirs(wd)
  checkpoint.save_best(workdir_lib.best_manager(wd), 30, {"w": np.ones(2, np.float32)}, 71.234)
  with open(os.path.join(wd, "results.json"), "w", encoding="utf-8") as f:
    json.dump({}, f)
  text = "\n".join(workdir_lib.run_summary(wd))
  assert "71.23 at step 30" in text
  assert os.path.join(wd, "results.json") in text and os.path.join(wd, "best", "30") in text
  assert f"tensorboard --logdir {os.path.join(wd, 'tensorboard')}" in text
  assert f"python -m micse_jax.convert --workdir {wd} --best --output" in text
  bare = "\n".join(workdir_lib.run_summary(str(tmp_path / "other")))
  assert "none" in bare and "--best" not in bare


# ------------------------------------------------------------------ config checks

def _config(**changes):
  from micse_jax.configs import default
  config = default.get_config()
  for key, value in changes.items():
    set_dotted(config, key, value)
  return config


def test_the_shipped_configs_pass_the_field_checks():
  from micse_jax.configs import ami_simcse, micse, moco_simcse, simcse
  for module in (ami_simcse, micse, moco_simcse, simcse):
    config_checks.check_fields(module.get_config())


@pytest.mark.parametrize("field,value", [
    ("optim.learning_rate", 0.0), ("optim.learning_rate", float("inf")), ("ami.weight", -1e-3),
    ("loss.temperature", -0.05), ("momentum.dropout", -0.1), ("momentum.decay", 1.5),
    ("momentum.queue_size", -1), ("eval_every", -5), ("batch_size", 1), ("optim.b2", 1.0),
    ("model.max_length", 1), ("model.dtype", "float8"), ("num_train_steps", 0),
])
def test_out_of_range_fields_are_named(field, value):
  with pytest.raises(errors.ConfigError, match=field.replace(".", r"\.")):
    config_checks.check_fields(_config(**{field: value}))


def test_resume_compatibility_names_only_run_defining_fields(tmp_path):
  old = _config()
  saved = {**json.loads(json.dumps(old.to_dict())), "model_dir": "/m", "bert_config": {"x": 1}}
  longer = _config(num_train_steps=40_000, log_every=50, **{"eval.batch_size": 7})
  assert config_checks.config_differences(saved, longer.to_dict()) == []
  other = _config(**{"model.name_or_path": "roberta-base", "ami.enabled": False})
  assert config_checks.config_differences(saved, other.to_dict()) == [
      "ami.enabled (True -> False)", "model.name_or_path ('bert-base-uncased' -> 'roberta-base')"]
  wd = str(tmp_path)
  workdir_lib.write_run_config(wd, saved)
  config_checks.check_resume_compatible(other, wd)  # no checkpoints yet: nothing to resume
  os.makedirs(os.path.join(wd, workdir_lib.ROLLING_DIR, "250"))
  config_checks.check_resume_compatible(longer, wd)
  with pytest.raises(errors.ConfigError, match=r"ami\.enabled.*model\.name_or_path.*new --workdir"):
    config_checks.check_resume_compatible(other, wd)


def test_a_workdir_resumes_across_rng_impl_with_one_line_saying_so(tmp_path):
  """The train state's key is threefry whatever generator draws the dropout bits (it seeds the rbg keys,
  `models/dropout.site_key`), so a checkpoint resumes under another generator (docs/precision.md): no
  difference refused, one line saying the masks after the checkpoint come from the new generator. An
  old config.json without the field drew with threefry."""
  saved = json.loads(json.dumps(_config().to_dict()))
  rbg = _config(**{"model.rng_impl": "rbg"})
  assert config_checks.config_differences(saved, rbg.to_dict()) == []
  wd = str(tmp_path)
  workdir_lib.write_run_config(wd, saved)
  os.makedirs(os.path.join(wd, workdir_lib.ROLLING_DIR, "250"))
  (note,) = config_checks.check_resume_compatible(rbg, wd)
  assert note.startswith("model.rng_impl changes on resume ('threefry' -> 'rbg'): the dropout masks of the "
                         "steps after the checkpoint are drawn by rbg instead of threefry") and "\n" not in note
  assert config_checks.check_resume_compatible(_config(), wd) == []  # nothing changed: nothing said
  del saved["model"]["rng_impl"]
  assert resume_checks.resume_notes(saved, rbg.to_dict()) == [note]
  assert resume_checks.resume_notes(saved, _config().to_dict()) == []


def test_any_chunk_size_resumes_any_run(tmp_path):
  """GradCache's blocks (`chunk_size`) are how the step is laid out in memory, the unblocked step to float
  rounding: a workdir resumes with another block size, or from before the field existed, without a line."""
  saved = json.loads(json.dumps(_config(chunk_size="0").to_dict()))
  for size in ("4", "auto", "0"):
    assert config_checks.config_differences(saved, _config(chunk_size=size).to_dict()) == []
    assert resume_checks.resume_notes(saved, _config(chunk_size=size).to_dict()) == []
  del saved["chunk_size"]
  assert config_checks.config_differences(saved, _config(chunk_size="8").to_dict()) == []


def test_a_longer_run_resumes_with_one_line_on_its_learning_rate():
  """num_train_steps may change on resume, but the learning rate decays linearly to 0 at num_train_steps
  (`optim.learning_rate_schedule`), so the steps left take other rates: one line says where the decay now
  ends (checked here against the schedule itself: the rate at the new end is 0, at the old end not)."""
  from micse_jax.training.optim import learning_rate_schedule
  saved = json.loads(json.dumps(_config(num_train_steps=1000).to_dict()))
  longer = _config(num_train_steps=2000)
  (note,) = resume_checks.resume_notes(saved, longer.to_dict())
  assert note.startswith("num_train_steps changes on resume (1000 -> 2000): the learning rate's linear decay to 0 "
                         "now ends at step 2000 instead of 1000") and "\n" not in note
  old, new = learning_rate_schedule(_config(num_train_steps=1000)), learning_rate_schedule(longer)
  assert float(old(1000)) == 0.0 < float(new(1000)) and float(new(2000)) == 0.0
  assert resume_checks.resume_notes(saved, _config(num_train_steps=1000, log_every=7).to_dict()) == []


def test_workdir_from_before_the_numpy_shuffle_is_refused_on_resume(tmp_path):
  """A workdir written with grain's batch order (no data.shuffle in config.json) cannot be resumed
  bit for bit; prefetch depth may change on resume."""
  old = _config()
  saved = json.loads(json.dumps(old.to_dict()))
  wd = str(tmp_path)
  os.makedirs(os.path.join(wd, workdir_lib.ROLLING_DIR, "250"))
  workdir_lib.write_run_config(wd, {**saved, "model_dir": "/m", "bert_config": {}})
  config_checks.check_resume_compatible(_config(**{"data.prefetch": 5}), wd)
  del saved["data"]["shuffle"]
  workdir_lib.write_run_config(wd, {**saved, "model_dir": "/m", "bert_config": {}})
  with pytest.raises(errors.ConfigError, match="grain's shuffle.*new --workdir") as e:
    config_checks.check_resume_compatible(old, wd)
  assert "\n" not in str(e.value)


# ------------------------------------------------------------------ the programs' command lines

PROGRAMS = ["main", "evaluate", "convert", "sweep", "prepare_data", "analyze"]


@pytest.mark.parametrize("program", PROGRAMS)
def test_help_prints_the_flags_and_exits_0(program):
  done = run_module(f"micse_jax.{program}", "--help")
  assert done.returncode == 0 and done.stderr == "", done.stderr
  assert "--" in done.stdout and "Try --helpfull" in done.stdout


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, minilm_dir):
  """A tiny model on disk and the `micse-train` command line of a run on a corpus that is not there."""
  from tests.train_utils import tiny_training_config
  root = tmp_path_factory.mktemp("overrides")
  config = tiny_training_config(root, minilm_dir)
  return ["micse_jax.main", "--config", "micse", "--workdir", str(root / "w"),
          f"--config.model.name_or_path={config.model.name_or_path}", "--config.eval_every=0",
          "--config.eval.final_tasks=", "--config.ami.layers=(0,1)", f"--config.data.corpus={root / 'no_corpus.txt'}"]


@pytest.mark.parametrize("overrides,expected", [
    (["--config.population.seeds=(1,2)", "--config.population.seeds=(3,)", "--config.population.learning_rates=(1e-3,2e-3)"],
     "population.learning_rates has 2 entries, population.seeds 1"),  # seeds (3,), not (1, 2, 3)
    (["--config.population.seeds", "(1,2)", "--config.population.seeds", "(3,)",
      "--config.population.learning_rates=(1e-3,2e-3)"], "population.learning_rates has 2 entries, population.seeds 1"),
    (["--config.ami.layers=(0,1)", "--config.ami.layers=(0,1)"], "corpus file not found"),  # not (0, 1, 0, 1)
    (["--config.batch_size=1", "--config.batch_size=8"], "corpus file not found"),  # a scalar: the same rule
], ids=["tuple", "tuple-spaced", "tuple-same-twice", "scalar"])
def test_a_repeated_override_replaces_the_earlier_one(tiny_run, overrides, expected):
  done = run_module(*tiny_run, *overrides)
  assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
  assert done.stderr.splitlines() == [done.stderr.strip()] and expected in done.stderr, done.stderr


def test_platform_choice_with_libtpu_installed_and_no_tpu_here():
  """libtpu (the `tpu` extra, beside the CUDA plugin or alone) where no TPU chip is: CPU, quietly;
  a TPU chip here, JAX_FORCE_TPU_INIT, or a GPU for the CUDA plugin: JAX's own choice."""
  script = ("import sys, jax; from jax._src import hardware_utils; from micse_jax import cli;"
            "plugins, libtpu, gpu, chips = sys.argv[1].split(',');"
            "cli._jax_plugins = lambda: ['xla_cuda13'] if plugins == 'cuda' else [];"
            "cli._tpu_library_installed = lambda: libtpu == 'libtpu';"
            "hardware_utils.has_visible_nvidia_gpu = lambda: gpu == 'gpu';"
            "hardware_utils.num_available_tpu_chips_and_device_id = lambda: (int(chips), None);"
            "print(cli.cpu_when_no_gpu(), repr(jax.config.jax_platforms))")
  outputs = {}
  for case in ("cuda,libtpu,-,0", "-,libtpu,-,0", "cuda,libtpu,-,4", "-,libtpu,-,4", "cuda,libtpu,gpu,0",
               "-,-,-,0", "force"):
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("JAX_PLATFORMS", None)
    if case == "force":
      env["JAX_FORCE_TPU_INIT"] = "1"
    done = subprocess.run([sys.executable, "-c", script, "-,libtpu,-,0" if case == "force" else case], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    outputs[case] = done.stdout.strip()
  assert outputs == {"cuda,libtpu,-,0": "True 'cpu'", "-,libtpu,-,0": "True 'cpu'", "cuda,libtpu,-,4": "False None",
                     "-,libtpu,-,4": "False None", "cuda,libtpu,gpu,0": "False None", "-,-,-,0": "False None",
                     "force": "False 'tpu,cpu'"}  # JAX's own choice when forced


def _installed(module: str) -> bool:
  import importlib.util
  return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not (_installed("libtpu") and cli._jax_plugins()),
                    reason="needs the extras 'tpu' and 'aot' installed together (libtpu and the CUDA plugin)")
def test_cpu_machine_with_the_tpu_and_aot_extras_starts_quietly(tiny_run):
  """A command that starts JAX and refuses its input: its one error line is all there is."""
  from jax._src import hardware_utils
  if hardware_utils.has_visible_nvidia_gpu() or hardware_utils.num_available_tpu_chips_and_device_id()[0]:
    pytest.skip("an accelerator is here")
  env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  env.pop("JAX_PLATFORMS", None)
  done = run_module(*tiny_run, "--config.batch_size=-3", env=env)
  assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
  assert done.stderr.splitlines() == ["error: invalid config: batch_size must be >= 2, got -3"], done.stderr
