"""The CLIs' shared rules: bad input is one line, a bug keeps its traceback, start-up is quiet,
a run ends with a summary; and the config checks that need no model."""
import json
import logging
import os

import numpy as np
import pytest

from micse_jax import cli, config_checks, errors
from micse_jax import workdir as workdir_lib
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


def test_a_workdir_written_before_rng_impl_resumes_with_threefry_only():
  """An old config.json has no model.rng_impl: its run drew dropout with threefry, so the default
  resumes it and another generator (a different random stream) is a named difference."""
  saved = json.loads(json.dumps(_config().to_dict()))
  del saved["model"]["rng_impl"]
  assert config_checks.config_differences(saved, _config(**{"model.rng_impl": "threefry"}).to_dict()) == []
  assert config_checks.config_differences(saved, _config(**{"model.rng_impl": "rbg"}).to_dict()) == [
      "model.rng_impl ('<absent>' -> 'rbg')"]


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
