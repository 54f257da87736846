"""`python -m micse_jax.bench --host`: what the host spends per training step, and dev selection.

Per step, for the text corpus (tokenized in memory) and a prepared corpus (ArrayRecord, written
to a temporary directory from the same sentences with the model's tokenizer, `max_length` 32 as
BERT-base miCSE runs use), at batch 50 and 512:

  batch      `TrainBatches.batch(step)` (epoch permutation slice, this host's rows, row_mask);
  placement  packing the keys into one array and `data_parallel.global_batch` (the device transfer), as
             the trainer places each step's batch (`data/packing.py`);
  host       their sum per step: the JSON line's `host_ms_per_step`.

Medians over `--host_steps` consecutive steps (epoch boundaries included: a new epoch's
permutation is drawn inside the step that starts it, so the mean is printed too). The prepared
corpus is read through once before its steps are timed, so its rows come from the page cache, as
they do for a corpus read before (an earlier epoch, or preparation on this host) or held in
memory: the figures are the host's CPU work, not the storage's latency (`_read_through`).

Dev selection: one STS-B dev evaluation (`evaluation.evaluators.dev_selection.PlannedPairs`, tokenized once,
compiled on a first untimed call) with the `--model` weights, against `eval_every` steps of the
full miCSE train step at `--batch_size`, i.e. the fraction of training time selection adds.

The last line printed is exactly `{"host_ms_per_step": {"text": {"50": x, "512": y},
"prepared": {"50": x, "512": y}}}` (milliseconds).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

BATCH_SIZES = (50, 512)
MAX_LENGTH = 32
SOURCES = ("text", "prepared")


def _corpus_file(directory: str, corpus: str, sentences: int) -> str:
  """The first `sentences` non-blank lines of `corpus` (cycled when it is shorter), as a file."""
  from micse_jax.data.corpus import read_corpus
  lines = read_corpus(corpus)
  lines = [lines[i % len(lines)] + ("" if i < len(lines) else f" ({i // len(lines)})") for i in range(sentences)]
  path = os.path.join(directory, "corpus.txt")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  return path


def _read_through(directory: str) -> None:
  """Reads every file of `directory` once, into the OS page cache.

  The timings are of the host's CPU work: a row read from storage instead of the page cache
  adds the storage's latency (BENCHMARKS.md: 0.07 ms a row on this project's CPU machine after
  dropping the page cache), which the prefetch thread overlaps with the device step."""
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), "rb") as f:
      while f.read(1 << 24):
        pass


def _time_steps(batches, mesh, steps: int) -> dict[str, list[float]]:
  """Per-step seconds of `batch(step)`, of the placement, and of both, over `steps` steps."""
  from micse_jax.data.packing import BatchLayout
  from micse_jax.training import data_parallel
  times, layout = {"batch": [], "placement": [], "host": []}, BatchLayout.of(batches.batch(0))
  for step in range(steps):
    t0 = time.perf_counter()
    local = batches.batch(step)
    t1 = time.perf_counter()
    data_parallel.global_batch(layout.pack(local), mesh)
    t2 = time.perf_counter()
    times["batch"].append(t1 - t0)
    times["placement"].append(t2 - t1)
    times["host"].append(t2 - t0)
  return times


def measure_host(model_dir: str, corpus: str, sentences: int, steps: int,
                 batch_sizes=BATCH_SIZES) -> dict:
  """{source: {batch: {part: {'median_ms', 'mean_ms'}}}} for the text and the prepared corpus."""
  from micse_jax.data.pipeline import build_train_batches
  from micse_jax.data.prepared import prepare_corpus
  from micse_jax.tokenization import Tokenizer
  from micse_jax.training import data_parallel
  tokenizer, mesh = Tokenizer.from_pretrained(model_dir), data_parallel.data_mesh()
  directory = tempfile.mkdtemp(prefix="micse_bench_host_")
  try:
    text = _corpus_file(directory, corpus, sentences)
    prepared = os.path.join(directory, "prepared")
    prepare_corpus(text, tokenizer, model_dir, MAX_LENGTH, prepared)
    result = {}
    for source, path in (("text", text), ("prepared", prepared)):
      result[source] = {}
      if source == "prepared":
        _read_through(path)
      for size in batch_sizes:
        batches = build_train_batches(path, tokenizer, max_length=MAX_LENGTH, global_batch_size=size, seed=0,
                                      process_index=0, process_count=1, show_progress=False)
        _time_steps(batches, mesh, 2)  # warm-up: first permutation, reader caches
        times = _time_steps(batches, mesh, steps)
        result[source][str(size)] = {part: {"median_ms": 1e3 * statistics.median(t),
                                            "mean_ms": 1e3 * statistics.mean(t)} for part, t in times.items()}
    return result
  finally:
    shutil.rmtree(directory, ignore_errors=True)


def measure_dev_selection(model_dir: str, batch_size: int, dtype: str, eval_every: int, eval_batch_size: int,
                          senteval_dir: str, steps: int = 3) -> dict | None:
  """One STS-B dev evaluation vs `eval_every` train steps (pipelined, as the trainer runs them);
  None without SentEval data."""
  import jax
  import transformers

  from micse_jax.bench import jax_step, timing
  from micse_jax.encoder import SentenceEncoder
  from micse_jax.evaluation import senteval_data
  from micse_jax.evaluation.evaluators.dev_selection import PlannedPairs
  from micse_jax.models.bert import BertModel
  from micse_jax.tokenization import Tokenizer
  if not os.path.isdir(senteval_dir):
    return None
  vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
  step = jax_step.JaxStep(model_dir, jax_step.random_batch(batch_size, MAX_LENGTH, vocab), dtype)
  step.compile()
  step_s = timing.measure(*timing.jax_peer(step), 1, steps, 1)["pipelined_step_ms"] / 1e3  # as the trainer runs
  encoder = SentenceEncoder(BertModel(step.nets.online.config, dtype=step.nets.online.dtype), None,
                            Tokenizer.from_pretrained(model_dir))
  t = time.perf_counter()
  split = PlannedPairs(encoder, senteval_data.load_stsb(senteval_dir)["dev"], eval_batch_size)
  plan_s = time.perf_counter() - t
  params = jax.device_get(step.state.params)
  split.spearman(params)  # compiles the encoder's bucket programs
  t = time.perf_counter()
  split.spearman(params)
  eval_s = time.perf_counter() - t
  return {"step_ms": 1e3 * step_s, "dev_eval_ms": 1e3 * eval_s, "dev_plan_ms_once": 1e3 * plan_s,
          "eval_every": eval_every, "dev_sentences": len(split.sentences),
          "fraction_of_step_time": eval_s / (eval_every * step_s)}


def report_lines(host: dict, dev: dict | None, model: str, batch_size: int) -> list[str]:
  """Human-readable lines of the host measurements."""
  lines = [f"micse_jax.bench --host: per step, max_length {MAX_LENGTH} (median ms; mean in brackets)"]
  for source in SOURCES:
    for size, parts in host[source].items():
      cells = "   ".join(f"{part} {v['median_ms']:.3f} ({v['mean_ms']:.3f})" for part, v in parts.items())
      lines.append(f"  {source:<9} batch {size:>4}: {cells}")
  if dev is None:
    lines.append("  dev selection: not measured (--no-host_dev, or no SentEval data)")
  else:
    lines.append(f"  dev selection ({model}, train batch {batch_size}): one STS-B dev evaluation "
                 f"({dev['dev_sentences']} sentences) {dev['dev_eval_ms']:.1f} ms, train step {dev['step_ms']:.1f} ms; "
                 f"every {dev['eval_every']} steps that adds {100 * dev['fraction_of_step_time']:.2f}% of step time "
                 f"(dev set tokenized once per run: {dev['dev_plan_ms_once']:.0f} ms)")
  return lines


def summary(host: dict) -> dict:
  """The JSON line: `{"host_ms_per_step": {source: {batch: median host ms}}}`."""
  return {"host_ms_per_step": {source: {size: round(parts["host"]["median_ms"], 4)
                                        for size, parts in host[source].items()} for source in SOURCES}}


def add_arguments(parser) -> None:
  """The `--host` flags of `python -m micse_jax.bench`."""
  parser.add_argument("--host", action="store_true",
                      help="measure the host side per step (batches, placement, dev selection) instead")
  parser.add_argument("--host_corpus", default=None,
                      help="sentences for --host (default: the shared english_mix corpus)")
  parser.add_argument("--host_sentences", type=int, default=20_000, help="corpus size for --host")
  parser.add_argument("--host_steps", type=int, default=200, help="timed steps per source and batch size")
  parser.add_argument("--host_dev", action=argparse.BooleanOptionalAction, default=True,
                      help="--host: also time one STS-B dev evaluation against eval_every train steps")
  parser.add_argument("--eval_every", type=int, default=125, help="--host_dev: steps between dev evaluations")


def run(args) -> dict:
  """Measures, prints the report and, as the last line, the JSON summary; returns the summary."""
  from micse_jax import jsonio, paths
  from micse_jax.bench import jax_step
  model_dir = jax_step.model_dir_for(args.model)
  corpus = args.host_corpus or paths.corpus_path("english_mix.txt")
  host = measure_host(model_dir, corpus, max(args.host_sentences, max(BATCH_SIZES)), args.host_steps)
  dev = None
  if args.host_dev:
    dev = measure_dev_selection(model_dir, args.batch_size, args.dtype, args.eval_every, 128, paths.senteval_dir())
  print("\n".join(report_lines(host, dev, args.model, args.batch_size)))
  line = summary(host)
  if args.output:
    jsonio.write_json(args.output, {**line, "details": host, "dev_selection": dev})
  print(json.dumps(line), flush=True)
  return line
