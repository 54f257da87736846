"""Tokenize a corpus once into a prepared (TFDS / ArrayRecord) directory for training at scale.

    python -m micse_jax.prepare_data --corpus wiki1m.txt --tokenizer bert-base-uncased \
        --max_length 32 --output data/wiki1m_bert32

Train on it with `--config.data.corpus=data/wiki1m_bert32` (the model's tokenizer and
`model.max_length` must match what is recorded). See `micse_jax/data/prepared.py`.
"""
import logging
import time

from absl import flags

from micse_jax import cli

flags.DEFINE_string("corpus", None, "UTF-8 text file, one sentence per line.")
flags.DEFINE_string("tokenizer", None, "Model directory or hub name whose tokenizer to use.")
flags.DEFINE_integer("max_length", 32, "Fixed (padded) length, including special tokens.")
flags.DEFINE_string("output", None, "Directory to create (must not exist).")
flags.DEFINE_integer("chunk_size", 8192, "Sentences tokenized per call.")
flags.mark_flags_as_required(["corpus", "tokenizer", "output"])
FLAGS = flags.FLAGS


def main(argv):
  """Tokenizes `--corpus` into a prepared directory `--output` (absl main)."""
  cli.reject_extra_args(argv)
  # Imported here, not at the top, so that `--help` and a flag error stay fast (no JAX, TFDS).
  from micse_jax.data.prepared import prepare_corpus
  from micse_jax.models.loading import resolve_model_dir
  from micse_jax.tokenization import Tokenizer
  start = time.perf_counter()
  logging.getLogger("absl").setLevel(logging.WARNING)  # no tfds INFO lines
  with cli.input_errors_as_one_line():  # bad input only (MicseError); anything else keeps its traceback
    tokenizer = Tokenizer.from_pretrained(resolve_model_dir(FLAGS.tokenizer))
    meta = prepare_corpus(FLAGS.corpus, tokenizer, FLAGS.tokenizer, FLAGS.max_length, FLAGS.output,
                          chunk_size=FLAGS.chunk_size)
  print(f"wrote {meta['num_sentences']} rows (max_length {meta['max_length']}, tokenizer "
        f"{meta['tokenizer']}) to {FLAGS.output} in {time.perf_counter() - start:.1f} s")


def run() -> None:
  """Entry point: `python -m micse_jax.prepare_data ...` or `micse-prepare-data ...`."""
  cli.run_program(main)


if __name__ == "__main__":
  run()
