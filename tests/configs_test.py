"""The packaged configs (issue 28): found by name from any directory, listed, and every derived
field follows a command-line override of the field it derives from."""
import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from micse_jax import configs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse(*argv):
  """The config a user gets from `micse-train --config ... --config.x=...` (config_flags)."""
  values, argv = flags.FlagValues(), ["prog", *argv]
  config_flags.DEFINE_config_file("config", None, "config", flag_values=values, lock_config=True,
                                  sys_argv=argv)
  values(argv)
  return values.config


@pytest.mark.parametrize("steps", [50, 7, 20_000])
def test_infocse_pretrain_steps_follow_num_train_steps(steps):
  """InfoCSE §3.1: the auxiliary network pre-trains for the first 10 % of the run's steps."""
  config = _parse(f"--config={configs.resolve('infocse:pretrain')}", f"--config.num_train_steps={steps}")
  assert config.num_train_steps == steps
  assert config.infocse.pretrain_steps == int(steps * 0.1)  # 10 %, rounded down


def test_infocse_pretrain_steps_can_still_be_set():
  config = _parse(f"--config={configs.resolve('infocse:pretrain')}", "--config.num_train_steps=100",
                  "--config.infocse.pretrain_steps=3")
  assert config.infocse.pretrain_steps == 3


def test_names_resolve_to_the_packaged_files(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # no configs/ here
  package = os.path.dirname(configs.__file__)
  assert configs.resolve("micse:demo") == os.path.join(package, "micse.py") + ":demo"
  assert configs.resolve("configs/micse.py") == os.path.join(package, "micse.py")
  assert configs.resolve("sweeps/micse_paper:fewshot") == os.path.join(package, "sweeps", "micse_paper.py") + ":fewshot"
  own = tmp_path / "mine.py"
  own.write_text("")
  assert configs.resolve("mine.py:x") == "mine.py:x"  # an existing file is taken as it is
  for bad in ("nosuch", "methods", "../paths", "sweeps/nosuch:fewshot"):
    with pytest.raises(configs.ConfigNotFoundError, match="neither a file nor a packaged config"):
      configs.resolve(bad)


def test_list_configs_names_every_config_file(tmp_path):
  out = subprocess.run([sys.executable, "-m", "micse_jax.main", "--list_configs"], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()][:-1]
  package = os.path.join(REPO, "micse_jax", "configs")
  expected = sorted(f[:-3] for f in os.listdir(package) if f.endswith(".py") and f not in ("__init__.py", "methods.py", "population_fields.py"))
  expected += sorted("sweeps/" + f[:-3] for f in os.listdir(os.path.join(package, "sweeps"))
                     if f.endswith(".py") and f != "__init__.py")
  assert names == expected


def test_checkout_configs_is_the_package_folder():
  """The repository's top-level configs/ is the package's folder, not a copy that could drift."""
  assert os.path.realpath(os.path.join(REPO, "configs")) == os.path.join(REPO, "micse_jax", "configs")


def test_the_programs_resolve_only_the_config_flag(tmp_path, monkeypatch):
  """`--config NAME` and `--config=NAME` become the packaged file; overrides and other flags
  are left as they are."""
  from micse_jax import cli
  monkeypatch.chdir(tmp_path)
  micse = os.path.join(os.path.dirname(configs.__file__), "micse.py")
  argv = ["prog", "--config", "micse:demo", "--config.batch_size=4", "--workdir", "micse"]
  assert cli.resolve_config_argument(argv) == ["prog", "--config", micse + ":demo", "--config.batch_size=4",
                                               "--workdir", "micse"]
  assert cli.resolve_config_argument(["prog", "--config=micse"]) == ["prog", f"--config={micse}"]
