"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 (kernel_diet_test.py): the fused and
the unfused model's 20-step runs on 4 devices, state replicated and sharded; prints the differences."""
import json
import pathlib
import sys

import jax


def main(tmp, model_dir):
  from tests.flat_update_test import step_config
  from tests.kernel_diet_test import compare
  assert jax.device_count() == 4, jax.devices()
  results = {"num_devices": jax.device_count()}
  for variant in ("micse", "simcse"):
    for shard_state in (False, True):
      config = step_config(pathlib.Path(tmp), model_dir, variant, None, {})
      results[f"{variant} shard_state={shard_state}"] = compare(config, shard_state)
  print(json.dumps(results))


if __name__ == "__main__":
  main(*sys.argv[1:])
