"""The GPU kit's harness: measurements on a lent GPU and their reports (docs/GPU_ACCEPTANCE.md).

A part of the checkout, not of the installed library: `pip install .` ships `micse_jax` alone,
and nothing in `micse_jax` imports this package (tests/package_contents_test.py). What a user
runs to time the step and its PyTorch peers stays `python -m micse_jax.bench`; this package
uses the same pieces (`micse_jax.bench.jax_step`, `torch_step`, `timing`).

Modules: `kit` (the runner: its steps, the time budget, the rows, what comes back),
`kit_points` (the measurements of one process: JAX points with their compiled program and
profile, PyTorch peers, the population, device ceilings), `kit_report` (rows -> kit.md and the
calibration summary; installing a returned summary under docs/calibration/).
"""
