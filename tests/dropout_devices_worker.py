"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 (tests/dropout_rng_test.py): each
dropout generator's masks on a batch-sharded 4-device mesh against one device; prints JSON."""
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from micse_jax.models.dropout import RNG_IMPLS, Dropout

RATE = 0.3


def masks(impl: str, devices) -> np.ndarray:
  mesh = Mesh(np.array(devices), ("data",))
  rows = NamedSharding(mesh, PartitionSpec("data"))
  drop = jax.jit(lambda x, key: Dropout(RATE, 32, impl).apply({}, x, deterministic=False, rngs={"dropout": key}),
                 in_shardings=(rows, NamedSharding(mesh, PartitionSpec())), out_shardings=rows)
  return np.asarray(drop(jnp.ones((16, 32, 64)), jax.random.PRNGKey(5))) > 0


def main():
  assert jax.device_count() == 4, jax.devices()
  out = {}
  for impl in RNG_IMPLS:
    one, four = masks(impl, jax.devices()[:1]), masks(impl, jax.devices())
    blocks = four.reshape(4, -1)  # the rows each device holds
    expected = RATE ** 2 + (1 - RATE) ** 2
    agreement = [float(np.mean(blocks[i] == blocks[j])) for i in range(4) for j in range(i + 1, 4)]
    bound = 5 * np.sqrt(expected * (1 - expected) / blocks.shape[1])
    out[impl] = {"max_diff": float(np.max(one != four)), "agreement": agreement,
                 "block_agreement_ok": all(abs(a - expected) < bound for a in agreement)}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
