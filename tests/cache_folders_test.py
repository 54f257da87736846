"""Cache folders at the edges: one that cannot be written (read-only, or a file where it or a folder
above it should be) is left out of the run, which goes on and says so in one line, JAX's warnings
folded into it; one that fails mid-run is one line too; a moved cache folder is warm on its first run."""
import contextlib
import glob
import logging
import os
import shutil
import subprocess
import warnings

import jax
import ml_collections
import numpy as np
import pytest

from micse_jax import cache_healing, caches, jsonio
from tests.cache_healing_test import REPO, _compile_and_run, _plain_env
from tests.startup_cost_test import _train_command
from tests.train_utils import tiny_training_config

JAX_CACHE_WARNING = "persistent compilation cache"  # JAX's own UserWarning per program read or written


@contextlib.contextmanager
def _cache_at(root, **fields):
  """Both caches under `root` for the duration (JAX's compilation cache as it was afterwards)."""
  before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
  config = ml_collections.ConfigDict({"cache": {"dir": str(root), "compilation": True, "tokenized": True,
                                                "compilation_max_size": 2**30, **fields}})
  try:
    yield config, caches.enable_compilation_cache(config)
  finally:
    caches.enable_compilation_cache(ml_collections.ConfigDict({"cache": {"compilation": False}}))
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_enable_compilation_cache", before[1])


def _program_input(seed: float):
  return np.linspace(-1.0, seed, 12, dtype=np.float32).reshape(3, 4)  # a program (values) per test


def _jax_cache_warnings(run) -> list[str]:
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run()
  return [str(w.message) for w in caught if JAX_CACHE_WARNING in str(w.message)]


def _blocked(root, where: str):
  """`where` of the cache root made a file: the root itself or one of its two cache folders."""
  path = {"root": root, "compilation": root / caches.COMPILATION_DIR, "tokenized": root / caches.TOKENIZED_DIR}[where]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("a file where a cache folder should be\n", encoding="utf-8")
  return path


@pytest.mark.parametrize("where", ["root", "compilation", "tokenized"])
def test_a_cache_folder_that_is_a_file_is_left_out_with_one_line(tmp_path, where):
  root = tmp_path / "cache"
  blocked = _blocked(root, where)
  with _cache_at(root) as (config, compilation):
    assert (compilation is None) == (where in ("root", "compilation"))
    assert (caches.tokenized_cache_dir(config) is None) == (where in ("root", "tokenized"))
    x = _program_input(1.5)
    assert not _jax_cache_warnings(lambda: _compile_and_run(x))
    (line,) = caches.unusable_notes()
  assert f"{blocked} is a file, not a folder" in line and "--config.cache.dir" in line and "\n" not in line
  assert blocked.read_text(encoding="utf-8").startswith("a file where")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_cache_folder_is_left_out(tmp_path):
  root = tmp_path / "cache"
  (root / caches.COMPILATION_DIR).mkdir(parents=True)
  (root / caches.TOKENIZED_DIR).mkdir()
  for folder in (root / caches.COMPILATION_DIR, root / caches.TOKENIZED_DIR):
    folder.chmod(0o555)
  try:
    assert "Permission denied" in caches.unusable_reason(str(root / caches.COMPILATION_DIR))
    with _cache_at(root) as (config, compilation):
      assert compilation is None and caches.tokenized_cache_dir(config) is None
  finally:
    for folder in (root / caches.COMPILATION_DIR, root / caches.TOKENIZED_DIR):
      folder.chmod(0o755)


def test_a_usable_cache_folder_is_created_and_left_as_it_was(tmp_path):
  root = tmp_path / "new" / "cache"
  assert caches.unusable_reason(str(root / caches.COMPILATION_DIR)) is None
  assert os.listdir(root / caches.COMPILATION_DIR) == []  # the probe file is gone


def test_a_compilation_cache_that_fails_mid_run_is_one_line_and_the_run_goes_on(tmp_path, caplog):
  """The folder becomes a file after the run opened it: every read and write would fail (JAX warns
  per program); ours is one line and the programs compile and run without the cache."""
  root = tmp_path / "cache"
  with _cache_at(root) as (_, compilation):
    shutil.rmtree(compilation)
    _blocked(root, "compilation")
    with caplog.at_level(logging.WARNING):
      for seed in (2.5, 3.5):  # two programs: one line all the same
        x = _program_input(seed)
        found = []
        assert not _jax_cache_warnings(lambda: found.append(_compile_and_run(x)))
        np.testing.assert_allclose(found[0][0], np.tanh(x @ x.T) * 3.0 + x.sum(), rtol=1e-6)
  lines = [r.getMessage() for r in caplog.records if "compilation cache" in r.getMessage()]
  assert len(lines) == 1 and compilation in lines[0] and "goes on without it" in lines[0], lines


def test_a_verified_cache_whose_folder_fails_goes_on_without_it(caplog):
  class Unwritable:
    path = _path = "/shared/cache"
    eviction_enabled = True

    def get(self, key):
      raise PermissionError(13, "Permission denied", "/shared/cache/.lockfile")

    put = get
  cache = cache_healing.VerifiedCache(Unwritable())
  with caplog.at_level(logging.WARNING):
    assert cache.get("a") is None
    cache.put("a", b"value")
    assert cache.get("b") is None
  (line,) = [r.getMessage() for r in caplog.records]
  assert "Permission denied: /shared/cache/.lockfile" in line and "/shared/cache" in line


def test_a_moved_cache_folder_is_warm(tmp_path):
  """JAX would hash the folder's path into every key (XLA's autotuning cache folder inside it):
  a moved or renamed cache would miss everything once."""
  x = _program_input(4.5)
  with _cache_at(tmp_path / "before"):
    assert _compile_and_run(x)[1] == ["cache_misses"]
  shutil.move(tmp_path / "before", tmp_path / "after")
  with _cache_at(tmp_path / "after"):
    out, events = _compile_and_run(x)
  assert events == ["cache_hits"]
  np.testing.assert_allclose(out, np.tanh(x @ x.T) * 3.0 + x.sum(), rtol=1e-6)


# ---------------------------------------------------------------- real runs

def _run(config, workdir, cache_dir):
  done = subprocess.run([*_train_command(config, workdir), f"--config.cache.dir={cache_dir}"], env=_plain_env(),
                        cwd=REPO, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done


def _lines(stderr: str) -> list[str]:
  """stderr without progress-bar updates and the trainer's narration of its set-up (`set-up: ...`)."""
  return [line for line in stderr.replace("\r", "\n").splitlines()
          if line.strip() and not line.startswith(("tokenizing:", "train:")) and "] set-up: " not in line]


@pytest.mark.parametrize("where", ["root", pytest.param("compilation", marks=pytest.mark.slow),
                                   pytest.param("tokenized", marks=pytest.mark.slow)])
def test_training_with_a_cache_folder_that_is_a_file_goes_on_and_says_so_once(tmp_path, minilm_dir, where):
  """~30 s per case on the shared 2-core CPU: a tiny run, compiled without its cache."""
  blocked = _blocked(tmp_path / "cache", where)
  done = _run(tiny_training_config(tmp_path, minilm_dir), tmp_path / "w", tmp_path / "cache")
  lines = _lines(done.stderr)
  assert len(lines) == 1 and f"{blocked} is a file, not a folder" in lines[0], done.stderr[-3000:]
  assert "run finished" in done.stdout and blocked.read_text(encoding="utf-8").startswith("a file where")


@pytest.mark.slow  # two tiny runs, ~45 s on the shared 2-core CPU
def test_a_moved_cache_folder_is_warm_on_its_first_run(tmp_path, minilm_dir):
  config = tiny_training_config(tmp_path, minilm_dir)
  compile_s = []
  for name, cache in (("cold", "before"), ("moved", "after")):
    if name == "moved":
      shutil.move(tmp_path / "before", tmp_path / "after")
    done = _run(config, tmp_path / name, tmp_path / cache)
    assert not _lines(done.stderr), done.stderr[-3000:]
    compile_s.append(jsonio.read_json(str(tmp_path / name / "timeline.json"))["compile_s"])
  assert glob.glob(str(tmp_path / "after" / caches.COMPILATION_DIR / "*-cache"))
  assert compile_s[1] <= 0.25 * compile_s[0], compile_s
