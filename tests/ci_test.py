"""CI runs the README's set-up commands verbatim (issue 16): the README keeps them parseable."""
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout under test


def _readme_commands():
  spec = importlib.util.spec_from_file_location("readme_commands",
                                                os.path.join(REPO, ".ci", "readme_commands.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_readme_setup_has_the_main_and_test_commands():
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    commands = _readme_commands().setup_commands(f.read())
  assert commands["main"].startswith("pip install -r requirements.txt")
  assert "python -m micse_jax.main --config configs/micse.py:demo" in commands["main"]
  assert commands["test"].startswith("pip install -q -r requirements-test.txt")
  assert commands["test"].endswith("python -m pytest -n 2 --dist worksteal")


def test_parser_reads_only_the_setup_section():
  text = ("# t\n## Intro\n```bash\necho intro\n```\n## Set-up\nx\n```bash\necho main\n```\n"
          "y\n```bash\necho test\n```\n## Next\n```bash\necho later\n```\n")
  assert _readme_commands().setup_commands(text) == {"main": "echo main", "test": "echo test"}


def test_ci_script_builds_a_fresh_venv_and_runs_both_commands():
  with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
    script = f.read()
  assert "python3 -m venv" in script and "mktemp -d" in script
  assert "readme_commands.py main" in script and "readme_commands.py test" in script
  # lint runs after the test command, inside the same venv, with the pinned ruff
  assert script.index('bash -c "$test_cmd"') < script.index("\nruff check .\n")
  with open(os.path.join(REPO, "requirements-test.txt"), encoding="utf-8") as f:
    assert any(line.startswith("ruff==") for line in f)
