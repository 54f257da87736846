"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4 (see
sharded_state_test.py): the tiny miCSE run trained 6 steps on 4 devices with the state
replicated and with it sharded (mesh.shard_state); saves both final states and reports how
the sharded one was laid out."""
import json
import pathlib
import sys

import jax
import numpy as np


def flat_state(state) -> dict:
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in
          jax.tree_util.tree_leaves_with_path(jax.device_get(state)) if np.size(v)}


def final_state(config, workdir):
  """The workdir's latest state restored onto this process's devices with the trainer's shardings
  (`config.mesh.shard_state`: replicated or sharded)."""
  from tests.train_utils import restore_latest
  return restore_latest(config, workdir)


def main(tmp, tokenizer_dir):
  from micse_jax.training import trainer
  from tests.sharded_state_test import run_config
  assert jax.device_count() == 4, jax.devices()
  tmp = pathlib.Path(tmp)
  layout = {}
  for shard_state in (False, True):
    config = run_config(tmp, tokenizer_dir, shard_state)
    workdir = str(tmp / ("sharded" if shard_state else "replicated"))
    trainer.train_and_evaluate(config, workdir)
    assert json.load(open(f"{workdir}/config.json"))["model"]["dtype"] == "float32"  # auto, resolved on CPU
    state = final_state(config, workdir)
    np.savez(tmp / f"{'sharded' if shard_state else 'replicated'}_4dev.npz", **flat_state(state))
    if shard_state:  # per leaf: global shape and the shape each device holds
      layout = {jax.tree_util.keystr(k): [list(v.shape), list(v.addressable_shards[0].data.shape)]
                for k, v in jax.tree_util.tree_leaves_with_path(state) if np.size(v)}
  print(json.dumps({"num_devices": jax.device_count(), "layout": layout}))


if __name__ == "__main__":
  main(*sys.argv[1:])
