"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 (tests/column_sums_test.py): the two-stage
column sum (`column_sums._two_stage`, what a CUDA program runs) of a batch split over 4 devices, as
data parallelism gives it, with chunks fitted to each device's rows and to the whole batch's; prints
JSON: the values against NumPy and the compiled program's shapes."""
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from micse_jax.models import column_sums as cs

SENTENCES, TOKENS, COLUMNS = 64, 32, 768  # per device: 64 sentences' two views of 32 tokens


def summed(values, rows, devices: int) -> dict:
  """The two stages with chunks fitted to `devices` devices' rows: error against NumPy, the compiled
  program's per-device partial-sum rows and its collectives."""
  fn = jax.jit(functools.partial(cs._two_stage, devices=devices), in_shardings=rows)
  (got,) = fn(jax.device_put(values, rows))
  want = np.asarray(values, np.float64).reshape(-1, COLUMNS).sum(0)
  text = fn.lower(values).compile().as_text()
  return {"max_error": float(np.max(np.abs(np.asarray(got, np.float64) - want))),
          "max_sum": float(np.max(np.abs(want))),
          "partial_rows": sorted({int(r) for r in re.findall(r"f32\[(\d+),768\]", text)}),
          "collectives": sorted(set(re.findall(r"\b(all-reduce|all-gather|all-to-all|collective-permute|"
                                                r"reduce-scatter)(?:-start)?\(", text)))}


def main():
  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("data",))
  shape = (len(devices) * SENTENCES * 2, TOKENS, COLUMNS)
  values = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32) * 3.0 + 1.0
  rows = NamedSharding(mesh, PartitionSpec("data"))
  print(json.dumps({"per_device": summed(values, rows, len(devices)), "whole_batch": summed(values, rows, 1)}))


if __name__ == "__main__":
  main()
