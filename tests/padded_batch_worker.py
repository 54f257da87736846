"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=4: a few steps of the miCSE step
at global batch 50 on one device (no padding) and on 4 devices (the trainer's batches, padded
to 52 with 2 masked rows); prints the largest state and metric differences as one JSON line.

  python -m tests.padded_batch_worker TMP TOKENIZER_DIR [--steps N] [--set key=value ...]
"""
import argparse
import json
import pathlib

import jax
import numpy as np

BATCH = 50


def unpadded(batch: dict) -> dict:
  """The first BATCH rows of a padded global batch: the unpadded run's batch (`row_mask` all
  ones). Checks the padding rows are last."""
  from micse_jax.data.pipeline import ROW_MASK_KEY
  mask = batch[ROW_MASK_KEY]
  assert mask[:BATCH].all() and not mask[BATCH:].any(), mask
  return {k: v[:BATCH] for k, v in batch.items()}


def run_steps(run, devices, steps, padded):
  """`steps` steps on a mesh of `devices` from the initial state; (host state, metrics list)."""
  from micse_jax.training import program
  prog = program.of_runs(run.config, [run], devices)  # the trainer's program on these devices
  state = prog.initial_state([run])
  host_batch = lambda i: run.batches.batch(i) if padded else unpadded(run.batches.batch(i))  # padded: 52 rows
  metrics = []
  for i in range(steps):
    state, m, _ = prog.run(state, prog.place_batch([host_batch(i)]))
    metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
  return jax.device_get(state), metrics


def main():
  from micse_jax.training import run_inputs
  from tests.train_utils import set_dotted, tiny_training_config
  parser = argparse.ArgumentParser()
  parser.add_argument("tmp")
  parser.add_argument("tokenizer_dir")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--set", action="append", default=[], help="config override key=value")
  args = parser.parse_args()
  assert jax.device_count() == 4, jax.devices()
  config = tiny_training_config(pathlib.Path(args.tmp), args.tokenizer_dir, batch_size=BATCH,
                                **{"momentum.queue_size": 120, "data.num_sentences": 0})
  for item in args.set:
    key, value = item.split("=", 1)
    set_dotted(config, key, json.loads(value))
  run = run_inputs.prepare(config)
  run.encoder_params = jax.device_get(run.encoder_params)  # host copy: each run donates its own
  s1, m1 = run_steps(run, jax.devices()[:1], args.steps, padded=False)
  s4, m4 = run_steps(run, jax.devices(), args.steps, padded=True)
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                       if np.size(a) else 0.0, s1, s4)
  metric_diffs = {k: max(abs(a[k] - b[k]) for a, b in zip(m1, m4)) for k in m1[0]}
  queues = {"queue_ids_1dev": np.asarray(s1.queue.ids).tolist(), "queue_ids_4dev": np.asarray(s4.queue.ids).tolist(),
            "queue_ptr": [int(s1.queue.ptr), int(s4.queue.ptr)]} if config.momentum.enabled else {}
  print(json.dumps({"max_state_diff": max(jax.tree.leaves(diffs)), "metric_diffs": metric_diffs,
                    "metrics_1dev": m1, **queues}))


if __name__ == "__main__":
  main()
