"""Diagnostic figures of one model: `python -m micse_jax.analyze --model DIR_OR_WORKDIR --output DIR`.

Writes attention_histograms.png (per-slice joint histograms of the log attention of two dropout
views, with each slice's MI; miCSE App. D; each slice's attention entropy goes to analysis.json),
sts_cosine_vs_gold.png (STS-B test; App. C),
alignment_uniformity.png (Wang & Isola) and analysis.json with the numbers.
See micse_jax/studies/diagnostics.py.
"""
import os

from absl import flags

from micse_jax import cli
from micse_jax.optional import require

flags.DEFINE_string("model", None, "HF directory, hub name or training workdir.")
flags.DEFINE_string("checkpoint", "best", "For a workdir: best | latest | a step.")
flags.DEFINE_string("output", None, "Directory for the PNGs and analysis.json.")
flags.DEFINE_string("senteval_dir", None, "SentEval data (default: $MICSE_DATA_DIR/senteval, "
                    "else shared/data/senteval in or above the working directory).")
cli.define_member_flags("Analyze")
flags.DEFINE_integer("num_sentences", 64, "STS-B test sentences whose attention is histogrammed.")
flags.DEFINE_integer("seed", 0, "Dropout / sampling seed.")
flags.DEFINE_string("pooler", "cls_before_pooler", "Embedding pooler.")
flags.mark_flags_as_required(["model", "output"])
FLAGS = flags.FLAGS


def main(argv):
  """Writes the diagnostic figures and analysis.json of `--model` (absl main)."""
  cli.reject_extra_args(argv)
  require("matplotlib", "drawing figures (analyze)")  # before any file is written
  # Imported here, not at the top, so that `--help` and a flag error stay fast (no JAX).
  import numpy as np

  from micse_jax import paths, workdir
  from micse_jax.encoder import load_encoder
  from micse_jax.evaluation import report, senteval_data
  from micse_jax.evaluation.sts import cosine_rows, encode_unique
  from micse_jax.studies import diagnostics
  senteval_dir = FLAGS.senteval_dir or paths.senteval_dir()
  with cli.input_errors_as_one_line():  # bad input only (MicseError); anything else keeps its traceback
    stsb = senteval_data.load_stsb(senteval_dir)["test"]
    checkpoint = int(FLAGS.checkpoint) if FLAGS.checkpoint.isdigit() else FLAGS.checkpoint
    model = FLAGS.model if FLAGS.member is None else workdir.member_workdir(FLAGS.model, FLAGS.member,
                                                                             FLAGS.allow_stopped)
    encoder = load_encoder(model, checkpoint, allow_stopped=FLAGS.allow_stopped)
  os.makedirs(FLAGS.output, exist_ok=True)
  encode = lambda s: encoder.encode(s, FLAGS.pooler)
  sentences = list(dict.fromkeys(stsb.sentences1 + stsb.sentences2))
  embeddings, index = encode_unique(encode, sentences)
  e1 = embeddings[[index[s] for s in stsb.sentences1]]
  e2 = embeddings[[index[s] for s in stsb.sentences2]]
  _, spearman = diagnostics.cosine_vs_gold(cosine_rows(e1, e2), stsb.scores,
                                        os.path.join(FLAGS.output, "sts_cosine_vs_gold.png"))
  positive = stsb.scores > 4.0
  align, uniform = diagnostics.alignment_uniformity(e1[positive], e2[positive], embeddings)
  diagnostics.alignment_uniformity_plot(align, uniform, os.path.basename(os.path.normpath(FLAGS.model)),
                                     os.path.join(FLAGS.output, "alignment_uniformity.png"))
  att1, att2, mask = diagnostics.dropout_attention(encoder, sentences[:FLAGS.num_sentences], FLAGS.seed)
  mi = diagnostics.slice_mutual_information(att1, att2, mask, FLAGS.seed)
  entropy = diagnostics.attention_entropy(*diagnostics.deterministic_attention(encoder, sentences[:FLAGS.num_sentences]))
  diagnostics.attention_histograms(att1, att2, mask, mi, os.path.join(FLAGS.output, "attention_histograms.png"))
  document = {"model": os.path.abspath(FLAGS.model) if os.path.exists(FLAGS.model) else FLAGS.model,
              "stsb_test_spearman": spearman, "alignment": align, "uniformity": uniform,
              "num_positive_pairs": int(positive.sum()), "num_sentences_uniformity": len(sentences),
              "slice_mi": np.asarray(mi).tolist(), "mean_slice_mi": float(np.mean(mi)),
              "slice_entropy": entropy.tolist(), "mean_slice_entropy": float(np.mean(entropy))}
  report.write_json(os.path.join(FLAGS.output, "analysis.json"), document)
  print(f"STS-B test Spearman {spearman:.2f}, alignment {align:.3f}, uniformity {uniform:.3f}, "
        f"mean slice MI {float(np.mean(mi)):.3f}; figures in {FLAGS.output}")


def run() -> None:
  """Entry point: `python -m micse_jax.analyze ...` or `micse-analyze ...`."""
  cli.run_program(main)


if __name__ == "__main__":
  run()
