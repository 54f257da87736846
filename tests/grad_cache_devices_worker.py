"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=4: the GradCache step (`chunk_size` 4 at
batch 16: one row per device per block, four blocks) against the unblocked step on the same 4 devices,
for miCSE, SimCSE and the official AMI (`tests/grad_cache_test._compare_gradients`: the loss, every metric
and the gradient to 1e-5), then 2 steps of the trainer's program, blocked and not (the states); and the
dropout-attention kernels under `shard_map` on a block of each device's rows against the whole batch's
`reference`. Prints one JSON line.

    python -m tests.grad_cache_devices_worker TMP TOKENIZER_DIR
"""
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np


def kernel_blocks_on_the_mesh() -> float:
  """Largest |block − whole| of the interpreted kernels on 4 devices, 2 blocks of 1 row per device."""
  from micse_jax.kernels import dropout_attention as da
  from micse_jax.training import data_parallel
  from tests.grad_cache_test import KERNEL_HEADS, KERNEL_RATE, kernel_inputs
  mesh = data_parallel.data_mesh()
  (projection, biases, key_mask, words), whole = kernel_inputs()
  rows = np.arange(8).reshape(4, 2, 1)  # device d holds rows 2d, 2d+1: block i is row 2d+i of each
  worst = 0.0
  for index in range(2):
    picked = rows[:, index].reshape(-1)
    placed = jax.device_put((projection[picked], key_mask[picked]), data_parallel.batch_sharded(mesh))
    part = jax.jit(lambda p, m, i=index: da.dropout_attention(p, biases, m, words, KERNEL_RATE, KERNEL_HEADS,
                                                              interpret=True, mesh=mesh, rows=(jnp.int32(i), 2)))(*placed)
    worst = max(worst, float(np.max(np.abs(np.asarray(part) - whole[picked]))))
  return worst


def main(tmp, tokenizer_dir):
  from tests import grad_cache_test as g
  from tests.train_utils import prepared_program, steps_of
  assert jax.device_count() == 4, jax.devices()
  out = {"kernel_block_difference": kernel_blocks_on_the_mesh()}
  for name in ("micse", "simcse", "official_ami"):
    g._compare_gradients(g._variant_config(pathlib.Path(tmp) / name, tokenizer_dir, name))  # raises if not equal
    out[name] = "equal"
  config = g._variant_config(pathlib.Path(tmp) / "steps", tokenizer_dir, "micse")
  finals = [steps_of(*prepared_program(g._blocked(config, size)), 2)[1] for size in (0, 4)]
  out["state_difference"] = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b))))
                                for a, b in zip(jax.tree.leaves(finals[0].params), jax.tree.leaves(finals[1].params)))
  print(json.dumps(out))


if __name__ == "__main__":
  main(*sys.argv[1:])
