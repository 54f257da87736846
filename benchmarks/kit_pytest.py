"""A pytest plugin the kit loads into its GPU test runs (`-p benchmarks.kit_pytest`, with xdist):
the tests in decreasing order of the seconds they are expected to take, so that the workers start
the longest first and the run ends soon after its longest test (xdist hands out tests in
collection order).

`EXPECTED_S`: seconds per test function on an H200 with XLA's autotuning off, estimated from the
deviceless H100 compiles of each test's programs (docs/GPU_ACCEPTANCE.md); the order is what
counts, a test not named here is expected to take `DEFAULT_S`. Each run's JUnit XML records the
real seconds per test (kit.md), to correct the figures.
"""
from __future__ import annotations

EXPECTED_S = {
    "test_on_gpu_the_kernels_run_and_match_reference[T128-d128-bfloat16]": 40,
    "test_on_gpu_a_batch_50_step_with_the_kernels_is_the_explicit_paths": 30,
    "test_on_gpu_a_model_with_the_kernels_is_the_explicit_model": 15,
    "test_on_gpu_the_kernels_run_and_match_reference[T128-d32-float16]": 15,
    "test_on_gpu_trial_a_rematerialised_model_with_the_kernels_is_the_explicit_model[layer-False]": 12,
    "test_on_gpu_trial_a_rematerialised_model_with_the_kernels_is_the_explicit_model[full-True]": 12,
    "test_on_gpu_population_members_keep_their_own_masks_and_gradients": 8,
}
DEFAULT_S = 5


def expected_s(name: str) -> float:
  """The seconds test `name` (its node name, parameters included) is expected to take."""
  return EXPECTED_S.get(name, DEFAULT_S)


def pytest_collection_modifyitems(config, items):
  """Longest first; a stable sort keeps the file's order among equals."""
  items.sort(key=lambda item: -expected_s(item.name))
