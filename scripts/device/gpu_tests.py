"""The acceptance kit's test row: runs this checkout's tests marked `gpu` and appends one row.

    python scripts/device/gpu_tests.py --out OUT [--budget_s S]

A driver of the repository's tests, so it lives beside the repository (scripts/device/), not in
the installed library: `scripts/device/acceptance.sh` runs it in part 1, before
`python -m micse_jax.bench.acceptance`, and the row lands in the same OUT/acceptance.jsonl
(counts from pytest's JUnit XML; skips count, so a CPU dry run shows every gpu test skipped).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from micse_jax.bench.acceptance import ROWS_FILE
from micse_jax.bench.rows import append_json_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def junit_counts(path: str) -> dict:
  """tests / failures / errors / skipped of a pytest JUnit XML file (zeros when it is absent)."""
  counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
  if not os.path.isfile(path):
    return counts
  suite = ET.parse(path).getroot()
  suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
  return {k: int(suite.get(k, 0)) for k in counts}


def main(argv=None) -> int:
  """Runs `pytest -m gpu tests` from the repository root; appends the row; returns pytest's code."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--budget_s", type=float, default=120.0, help="pytest time-out (s)")
  args = p.parse_args(argv)
  junit = os.path.join(tempfile.mkdtemp(prefix="micse_gpu_tests_"), "gpu_tests.xml")
  t = time.monotonic()
  proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                         f"--junitxml={junit}", "tests"], capture_output=True, text=True, cwd=REPO,
                        timeout=max(args.budget_s, 30))
  print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
  ok = proc.returncode in (0, 5)  # 5: no test selected
  os.makedirs(args.out, exist_ok=True)
  append_json_line(os.path.join(args.out, ROWS_FILE),
                   {"part": 1, "row": "gpu_tests", "ok": ok, "returncode": proc.returncode,
                    "seconds": time.monotonic() - t, **junit_counts(junit),
                    "tail": "" if ok else (proc.stdout + proc.stderr)[-1500:]})
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
