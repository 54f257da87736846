"""Every third-party import is declared (issue 16): a newcomer's `pip install` brings it.

Walks every module of `micse_jax/` (its `configs/` too; imports inside functions too),
maps each third-party top-level import to its distribution with the installed packages'
metadata, and checks it against `requirements.txt` (the tested pins) and `pyproject.toml`.

* A *required* import (a plain `import x` anywhere, not guarded) must be pinned in
  requirements.txt and listed in pyproject's `dependencies`.
* An *optional* import (`micse_jax.optional.require("x", ...)`, or an import guarded by
  `except ImportError`) may instead be listed in one of pyproject's optional extras, and pinned
  in requirements.txt or requirements-test.txt.
* Test-only imports (`tests/`) must be pinned in requirements-test.txt (which includes
  requirements.txt).
"""
import ast
import importlib.metadata
import os
import re
import sys
import tomllib

import pytest

from micse_jax import optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout under test

FIRST_PARTY = {"micse_jax", "tests", "benchmarks", "__future__"}  # a top-level `configs` would be third party
SOURCE_DIRS = ("micse_jax",)  # configs included (micse_jax/configs); scripts/device/ runs on the GPU image's own Python


def _normalize(name: str) -> str:
  """PEP 503 normalised distribution name."""
  return re.sub(r"[-_.]+", "-", name).lower()


def distribution_name(spec: str) -> str:
  """The normalised distribution name of a requirement line (`jax>=0.10; python_version...`)."""
  return _normalize(re.split(r"[<>=!~\[; ]", spec.strip())[0])


def _is_import_error_guard(handler: ast.ExceptHandler) -> bool:
  names = []
  if isinstance(handler.type, ast.Name):
    names = [handler.type.id]
  elif isinstance(handler.type, ast.Tuple):
    names = [e.id for e in handler.type.elts if isinstance(e, ast.Name)]
  return bool({"ImportError", "ModuleNotFoundError"} & set(names))


def _require_target(node: ast.Call) -> str | None:
  """The module name of a `require("module", ...)` call, else None."""
  func = node.func
  name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
  if name == "require" and node.args and isinstance(node.args[0], ast.Constant) \
      and isinstance(node.args[0].value, str):
    return node.args[0].value
  return None


def imports_of(source: str, with_require: bool = True) -> dict[str, bool]:
  """{top-level module: optional?} for every import in `source` (a module is optional only if
  every import of it is `require(...)`d or guarded by `except ImportError`)."""
  tree = ast.parse(source)
  guarded = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Try) and any(_is_import_error_guard(h) for h in node.handlers):
      for stmt in node.body:
        guarded.update(id(n) for n in ast.walk(stmt))
  found: dict[str, bool] = {}

  def add(module: str, is_optional: bool) -> None:
    top = module.split(".")[0]
    found[top] = found.get(top, True) and is_optional

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        add(alias.name, id(node) in guarded)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      add(node.module, id(node) in guarded)
    elif with_require and isinstance(node, ast.Call) and _require_target(node):
      add(_require_target(node), True)
  return found


def third_party(found: dict[str, bool]) -> dict[str, bool]:
  return {m: opt for m, opt in found.items() if m not in FIRST_PARTY and m not in sys.stdlib_module_names}


def _python_files(*dirs: str) -> list[str]:
  out = []
  for d in dirs:
    for root, _, files in os.walk(os.path.join(REPO, d)):
      out.extend(os.path.join(root, f) for f in files if f.endswith(".py"))
  return sorted(out)


def _imports_under(*dirs: str, with_require: bool = True) -> dict[str, dict[str, bool]]:
  """{module: {file: optional?}} over the files under `dirs` (`require(...)` calls counted
  unless `with_require` is False: in tests they are the subject, not a dependency)."""
  table: dict[str, dict[str, bool]] = {}
  for path in _python_files(*dirs):
    with open(path, encoding="utf-8") as f:
      for module, is_optional in third_party(imports_of(f.read(), with_require)).items():
        table.setdefault(module, {})[os.path.relpath(path, REPO)] = is_optional
  return table


def read_requirements(name: str) -> set[str]:
  """Normalised distribution names pinned in a requirements file (following `-r`)."""
  names = set()
  with open(os.path.join(REPO, name), encoding="utf-8") as f:
    for line in f:
      line = line.split("#")[0].strip()
      if line.startswith("-r"):
        names |= read_requirements(line[2:].strip())
      elif line:
        names.add(distribution_name(line))
  return names


def _pyproject() -> dict:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]


def _names(specs) -> set[str]:
  return {distribution_name(s) for s in specs}


# Extras whose wheels (~1 GB, pinned to one jax version) the test environment does not install:
# their optional imports are checked against these pins and `optional.OPTIONAL` instead.
UNINSTALLED_EXTRA_PINS = ("requirements-aot.txt", "requirements-aot-v100.txt", "requirements-tpu.txt")


def uninstalled_extra_pins() -> set[str]:
  """Normalised distributions pinned for the extras the test environment does not install."""
  return set().union(*(read_requirements(name) for name in UNINSTALLED_EXTRA_PINS))


def distribution_of(module: str) -> str:
  """The installed distribution that provides top-level import `module` (or, for an extra the
  tests do not install, the distribution `optional.OPTIONAL` names when it is pinned for it)."""
  dists = importlib.metadata.packages_distributions().get(module)
  declared = optional.OPTIONAL.get(module)
  if not dists and declared and _normalize(declared[0]) in uninstalled_extra_pins():
    return _normalize(declared[0])
  if not dists:
    pytest.fail(f"import {module!r} maps to no installed distribution: undeclared or not installed")
  return _normalize(dists[0])


def test_every_runtime_import_is_declared():
  pins, test_pins = read_requirements("requirements.txt"), read_requirements("requirements-test.txt")
  project = _pyproject()
  required = _names(project["dependencies"])
  extras = set().union(*(_names(v) for v in project.get("optional-dependencies", {}).values()))
  problems = []
  for module, files in sorted(_imports_under(*SOURCE_DIRS).items()):
    dist = distribution_of(module)
    is_optional = all(files.values())
    where = ", ".join(sorted(f for f, opt in files.items() if not opt) or sorted(files))
    if not is_optional and not (dist in pins and dist in required):
      problems.append(f"{module} ({dist}) imported unguarded in {where}: needs requirements.txt "
                      f"and pyproject dependencies")
    if is_optional and not ((dist in pins | test_pins | uninstalled_extra_pins()) and dist in required | extras):
      problems.append(f"{module} ({dist}) imported optionally in {where}: needs a pin and a "
                      f"pyproject dependency or extra")
  assert not problems, "\n".join(problems)


def test_every_test_import_is_pinned_for_tests():
  test_pins = read_requirements("requirements-test.txt")
  missing = {m: sorted(files) for m, files in _imports_under("tests", with_require=False).items()
             if distribution_of(m) not in test_pins}
  assert not missing, f"test imports missing from requirements-test.txt: {missing}"


def test_optional_table_matches_pyproject_extras():
  """`micse_jax/optional.py` names, for each optional import, an extra that really lists it."""
  extras = {k: _names(v) for k, v in _pyproject().get("optional-dependencies", {}).items()}
  for module, (dist, extra) in optional.OPTIONAL.items():
    assert extra in extras, f"{module}: pyproject has no extra {extra!r}"
    assert _normalize(dist) in extras[extra], f"{module}: extra {extra!r} does not list {dist}"
    assert distribution_of(module) == _normalize(dist), module


def test_pyproject_dependencies_have_tested_ranges():
  """Ranges, not bare names: a lower bound at the tested pin for each runtime dependency."""
  bare = [s for s in _pyproject()["dependencies"] if not re.search(r"[<>=~]", s)]
  assert not bare, f"bare dependency names in pyproject.toml: {bare}"


def test_checker_classifies_imports():
  """The checker itself on a hand-written module: plain, in-function, guarded, require()'d."""
  source = (
      "import os\nimport numpy as np\nfrom scipy import stats\n"
      "def f():\n  import yaml\n  from micse_jax import paths\n"
      "try:\n  import torch\nexcept ImportError:\n  torch = None\n"
      "def g():\n  return require('jmp', 'fp16'), optional.require('matplotlib.pyplot', 'plots')\n"
      "from . import sibling\n")
  assert third_party(imports_of(source)) == {
      "numpy": False, "scipy": False, "yaml": False, "torch": True, "jmp": True, "matplotlib": True}


def test_checker_sees_an_unguarded_use_of_an_optional_package():
  """A module imported both ways counts as required (one unguarded import is enough)."""
  source = "def f():\n  return require('jmp', 'x')\nimport jmp\n"
  assert imports_of(source)["jmp"] is False
