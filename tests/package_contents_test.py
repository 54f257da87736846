"""`pip install .` ships the library alone: the GPU kit's harness (benchmarks/, scripts/device/)
stays in the checkout, and nothing the wheel ships imports it."""
import ast
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKOUT_ONLY = {"benchmarks", "scripts", "tests", "launch", "configs"}  # top-level names the wheel must not hold


def _shipped_packages() -> list[str]:
  """The packages setuptools finds with pyproject.toml's `packages.find` settings."""
  setuptools = pytest.importorskip("setuptools")
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    find = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
  return setuptools.find_packages(where=REPO, include=find["include"], exclude=find.get("exclude", ()))


def test_the_wheel_finds_only_the_library_and_no_kit_harness():
  packages = _shipped_packages()
  assert "micse_jax.bench" in packages and "micse_jax" in packages
  assert all(p == "micse_jax" or p.startswith("micse_jax.") for p in packages), packages
  bench = os.path.join(REPO, "micse_jax", "bench")
  assert not [f for f in os.listdir(bench) if f.startswith(("acceptance", "kit", "calibrat"))]


def test_no_shipped_module_imports_the_checkouts_harness():
  found = []
  for root, _, files in os.walk(os.path.join(REPO, "micse_jax")):
    for name in (f for f in files if f.endswith(".py")):
      path = os.path.join(root, name)
      with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
      for node in ast.walk(tree):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found += [f"{os.path.relpath(path, REPO)}: {m}" for m in modules if m.split(".")[0] in CHECKOUT_ONLY]
  assert not found


@pytest.mark.slow  # builds the wheel (setuptools, offline, no build isolation): about 20 s
def test_the_built_wheel_holds_no_harness_module(tmp_path):
  pytest.importorskip("setuptools")
  source = tmp_path / "src"  # a copy of the checkout, so that the build leaves nothing in it
  shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".kit*", "__pycache__", "build", "*.egg-info"),
                  symlinks=True)
  proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                         "-q", "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (wheel,) = os.listdir(tmp_path / "dist")
  names = zipfile.ZipFile(tmp_path / "dist" / wheel).namelist()
  top = {n.split("/")[0] for n in names}
  assert top == {"micse_jax"} | {t for t in top if t.endswith(".dist-info")}, top
  assert "micse_jax/bench/timing.py" in names and "micse_jax/bench/__main__.py" in names
  assert not [n for n in names if "acceptance" in n or "/kit" in n or "benchmarks" in n]
