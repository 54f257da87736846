"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=N: compiles the miCSE train step
for N devices and prints its collective table (aot/collectives.py) and the size of the
gathered projected embeddings z (padded B x D float32) as one JSON line.

  python -m tests.hlo_step_worker TMP TOKENIZER_DIR [--model DIR] [--batch B] [--queue Q] [--max-length T] [--dump FILE]
"""
import argparse
import json
import pathlib

import jax


def compiled_step_text(config, mesh):
  """The optimised HLO text of the jitted, sharded train step on `mesh`."""
  from micse_jax.training import program, run_inputs
  run = run_inputs.prepare(config)
  prog = program.of_runs(config, [run], mesh.devices.flat)  # the trainer's program on `mesh`'s devices
  return prog.lower().compile().as_text(), run.bert_config.hidden_size


def main():
  from micse_jax.aot.collectives import collective_table
  from micse_jax.aot.hlo_module import parse
  from micse_jax.training import data_parallel
  from tests.train_utils import tiny_training_config
  parser = argparse.ArgumentParser()
  parser.add_argument("tmp")
  parser.add_argument("tokenizer_dir")
  parser.add_argument("--model", default="")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--queue", type=int, default=12)
  parser.add_argument("--max-length", type=int, default=16)
  parser.add_argument("--dump", default="", help="also write the optimised HLO text here")
  args = parser.parse_args()
  overrides = {"batch_size": args.batch, "momentum.queue_size": args.queue, "data.num_sentences": 0,
               "model.max_length": args.max_length}
  config = tiny_training_config(pathlib.Path(args.tmp), args.tokenizer_dir, **overrides)
  if args.model:
    config.model.name_or_path = args.model
  text, dim = compiled_step_text(config, data_parallel.data_mesh())
  rows = data_parallel.padded_batch_size(args.batch, jax.device_count())  # z is gathered with its padding rows
  if args.dump:
    pathlib.Path(args.dump).write_text(text, encoding="utf-8")
  print(json.dumps({"num_devices": jax.device_count(), "z_bytes": rows * dim * 4,
                    "table": collective_table(parse(text))}))


if __name__ == "__main__":
  main()
