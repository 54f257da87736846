"""Kept for old command lines: the benchmark now lives in the package, `python -m micse_jax.bench`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from micse_jax.bench.__main__ import main  # pylint: disable=wrong-import-position

if __name__ == "__main__":
  main()
