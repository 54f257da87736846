"""Prints one of the README's set-up commands, so that CI runs them verbatim.

The README's "## Set-up" section holds two fenced bash blocks: the main command (install and
run the demo) and the test command. `python3 .ci/readme_commands.py main|test` prints one of
them; `.ci/run` executes what it prints. Standard library only: it runs before any install.
"""
import os
import re
import sys

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def setup_commands(text: str) -> dict[str, str]:
  """{'main': ..., 'test': ...} from the first two ```bash blocks of the Set-up section."""
  section = re.search(r"^## Set-up\n(.*?)(?=^## )", text, re.S | re.M)
  if not section:
    raise SystemExit("README.md has no '## Set-up' section")
  blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
  if len(blocks) < 2:
    raise SystemExit("README.md's Set-up section needs two ```bash blocks (main, tests)")
  return {"main": blocks[0].strip(), "test": blocks[1].strip()}


if __name__ == "__main__":
  with open(README, encoding="utf-8") as f:
    print(setup_commands(f.read())[sys.argv[1]])
