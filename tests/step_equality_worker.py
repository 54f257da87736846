"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=4: a test module's `compare(config,
shard_state)` (update_step_test: the fused update vs the per-leaf optax update; weight_copies_test:
half-precision weight copies vs casts in the step) over 20 steps
on 4 devices, state replicated and sharded, at `model.dtype` DTYPE (default: the config's float32);
prints the differences.

    python -m tests.step_equality_worker TMP MODEL_DIR tests.update_step_test [DTYPE]
"""
import importlib
import json
import pathlib
import sys

import jax


def main(tmp, model_dir, test_module, dtype=None):
  from tests.update_step_test import step_config
  compare = importlib.import_module(test_module).compare
  assert jax.device_count() == 4, jax.devices()
  results = {"num_devices": jax.device_count()}
  for variant in ("micse", "simcse"):
    for shard_state in (False, True):
      config = step_config(pathlib.Path(tmp), model_dir, variant, None, {"model.dtype": dtype} if dtype else {})
      results[f"{variant} shard_state={shard_state}"] = compare(config, shard_state)
  print(json.dumps(results))


if __name__ == "__main__":
  main(*sys.argv[1:])
