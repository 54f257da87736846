"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4: 2 steps on a
4-device mesh vs the 1-device mesh on the same global batch; prints the max abs difference."""
import json
import pathlib
import sys

import jax
import numpy as np


def main(tmp, tokenizer_dir):
  from micse_jax import caches
  from micse_jax.training import program, run_inputs
  from tests.train_utils import tiny_training_config
  assert jax.device_count() == 4, jax.devices()
  # n = B: step 1's anchors all meet their own sentence in the queue, so the same-sentence mask
  # (sharded anchor ids against the replicated queue ids) is part of what must match.
  config = tiny_training_config(pathlib.Path(tmp), tokenizer_dir, **{"data.num_sentences": 8})
  caches.enable_compilation_cache(config)  # as the trainer: programs other runs compiled are read back
  run = run_inputs.prepare(config)
  run.encoder_params = jax.device_get(run.encoder_params)  # host copy: each run donates its own
  finals = []
  for devices in (jax.devices()[:1], jax.devices()):
    prog = program.of_runs(config, [run], devices)  # the trainer's program on these devices
    state = prog.initial_state([run])
    losses = []
    for i in range(2):
      state, metrics, _ = prog.run(state, prog.place_batch([run.batches.batch(i)]))
      losses.append(float(metrics["loss"]))
    finals.append((jax.device_get(state), losses))
  (s1, l1), (s4, l4) = finals
  max_abs = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
  diffs = jax.tree.leaves(jax.tree.map(lambda a, b: max_abs(a, b) if np.size(a) else 0.0, s1, s4))
  print(json.dumps({"max_state_diff": max(diffs), "loss_1dev": l1, "loss_4dev": l4,
                    "num_devices": len(jax.devices())}))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
