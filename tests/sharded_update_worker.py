"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 (tests/sharded_update_test.py): the tiny
miCSE program on 4 devices, 3 steps with the update replicated and sharded (`mesh.shard_update`,
ZeRO-1/2); prints the largest state difference, where the sharded state lives and its collectives."""
import json
import pathlib
import sys

import jax
import numpy as np

from micse_jax.aot import collectives, hlo_module


def run(config, run_inputs):
  """(final state on the host, compiled HLO, {leaf: per-device shape}) of 3 steps of the trainer's program."""
  from micse_jax.training import program
  prog = program.compiled(program.of_runs(config, [run_inputs], jax.devices()))
  state = prog.initial_state([run_inputs])
  for i in range(3):
    state = prog.run(state, prog.place_batch([run_inputs.batches.batch(i)]))[0]
  local = {jax.tree_util.keystr(k): list(v.addressable_shards[0].data.shape)
           for k, v in jax.tree_util.tree_leaves_with_path(state) if np.size(v)}
  host = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(state))
          if np.size(v)}
  return host, prog.executable.as_text(), local


# A first moment this small is a gradient at the noise of float32 sums (a key bias, a rare token's
# embedding): Adam's step there, about lr * g / |g|, is decided by the order of the sums, whichever update.
NOISE_MOMENT = 1e-8


def _difference(plain: dict, split: dict, name: str) -> float:
  """The largest |plain - split| of one leaf; a param's elements whose first moment is at noise level left out."""
  diff = np.abs(plain[name].astype(np.float64) - split[name])
  if name.startswith(".params"):
    mu = next((v for k, v in plain.items() if k.endswith(".mu" + name[len(".params"):])), None)
    diff = diff if mu is None else np.where(np.abs(mu) < NOISE_MOMENT, 0.0, diff)
  return float(np.max(diff))


def main(tmp, tokenizer_dir):
  from micse_jax import caches
  from micse_jax.training import run_inputs
  from tests.train_utils import tiny_training_config
  assert jax.device_count() == 4, jax.devices()
  out = {}
  for shard_update in (False, True):
    config = tiny_training_config(pathlib.Path(tmp), tokenizer_dir, **{
        "mesh.shard_update": shard_update, "mesh.shard_min_elements": 1024})
    caches.enable_compilation_cache(config)  # as the trainer: programs other runs compiled are read back
    host, text, local = run(config, run_inputs.prepare(config))
    out[str(shard_update)] = {"host": host, "collectives": collectives.collective_table(hlo_module.parse(text)), "local": local}
  plain, split = out["False"], out["True"]
  worst = max(_difference(plain["host"], split["host"], k) for k in plain["host"]
              if np.issubdtype(plain["host"][k].dtype, np.floating))
  exact = all(np.array_equal(plain["host"][k], split["host"][k]) for k in plain["host"]
              if not np.issubdtype(plain["host"][k].dtype, np.floating))
  print(json.dumps({"worst": worst, "ints_equal": exact, "local": split["local"],
                    "collectives": {k: v["collectives"] for k, v in out.items()}}))


if __name__ == "__main__":
  main(*sys.argv[1:])
