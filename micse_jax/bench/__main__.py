"""Benchmark the miCSE training step (micse_jax vs PyTorch, one process) and encoding.

    python -m micse_jax.bench --model minilm --batch_size 64
    python -m micse_jax.bench --model bert-base --batch_size 50 --dtype bfloat16 --profile /tmp/trace

Prints: compile time, model FLOPs (training/flops.py) and XLA's FLOP count of the train step; the step time of
micse_jax and of the PyTorch peers, each two ways (bench/timing.py): pipelined, runs of --steps steps with one
wait per run as the trainer runs them (the headline: ratios, sentences/s and MFU use it), and blocked, the
median of single steps each waited for; the step's time by phase (a profile of a
few full steps, each op under the step's `jax.named_scope` it belongs to: two-view encoding
forward and backward, each loss term, optimizer, EMA, momentum forward, enqueue; jax_step.py);
peak memory; MFU on GPUs with a known peak; the encode throughput of SentenceEncoder.encode against
sentence-transformers' encode (batch --encode_batch_size). Each figure is printed as soon as it
is measured and appended as one JSON row to --rows (bench/rows.py), and --output is rewritten
with the result so far after each row, so a late failure (out of memory at the PyTorch
baseline, say) loses nothing measured before it. A JSON line with every figure ends the output.
`--profile DIR` writes a jax.profiler trace of a few full steps (open with TensorBoard's
profile plugin or ui.perfetto.dev) and prints their op (XLA:CPU) or kernel (GPU) time by kind
(matrix multiplies, fusions, copies, ...; bench/trace_summary.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

import jax

from micse_jax import cli, jsonio
from micse_jax.aot import hlo, hlo_module
from micse_jax.aot.topology import TARGETS
from micse_jax.bench import aot, hardware, host, jax_step, scaling, timing, trace_summary
from micse_jax.bench.rows import Rows
from micse_jax.bench.torch_step import TORCH_MODES
from micse_jax.errors import MicseError, one_line
from micse_jax.models.dtypes import DTYPES
from micse_jax.optional import require
from micse_jax.training.xla_options import CUDA_GRAPHS


class _OneLineParser(argparse.ArgumentParser):
  """argparse with a bad flag or value as one `error:` line and exit 2, as every other program
  (`cli.fail`); the usage is printed on --help only."""

  def error(self, message):
    cli.fail(message, cli.USAGE_EXIT)


def _add_step_arguments(p) -> None:
  """The step's shape and layout: model, batch, length, dtype, GradCache blocks, dropout bits."""
  p.add_argument("--model", default="minilm",
                 help="minilm (shipped checkpoint) | bert-base | tiny (random weights) | a HF directory")
  p.add_argument("--batch_size", type=int, default=64, help="sentences per step (two views each)")
  p.add_argument("--max_length", type=int, default=32, help="tokens per sentence")
  p.add_argument("--dtype", default="float32", choices=DTYPES, help="compute dtype (params stay float32)")
  p.add_argument("--chunk_size", default="0", type=_chunk_size, metavar="N|auto",
                 help="chunk_size of the micse_jax step (training/grad_cache.py): global rows per block, 0 the whole "
                      "batch (no blocks), auto the largest block whose compiled step fits the device's memory "
                      "(training/chunk_choice.py); with --aot too")
  p.add_argument("--dropout_random_bits", type=int, default=32, choices=(32, 16),
                 help="model.dropout_random_bits of the micse_jax step (16: two draws per random word)")


def parse_args(argv):
  """The benchmark's command line (argparse)."""
  p = _OneLineParser(prog="python -m micse_jax.bench", description=__doc__.splitlines()[0])
  _add_step_arguments(p)
  timing.add_arguments(p)
  p.add_argument("--piece_steps", type=int, default=3, help="profiled full steps of the breakdown by phase")
  p.add_argument("--no_torch", action="store_true", help="skip the PyTorch baselines")
  p.add_argument("--torch_mode", default=",".join(TORCH_MODES),
                 help="comma-separated PyTorch peers: eager (the public code's way) and/or compiled "
                      "(torch.compile, SDPA outside AMI's layers, fused AdamW, foreach EMA)")
  p.add_argument("--no_breakdown", action="store_true", help="skip the breakdown by phase (a profile)")
  p.add_argument("--encode", action=argparse.BooleanOptionalAction, default=True,
                 help="compare encode throughput with sentence-transformers (default on); with --aot: compile the "
                      "encode program beside the step")
  p.add_argument("--encode_batch_size", type=int, default=128)
  p.add_argument("--encode_sentences", type=int, default=1024)
  p.add_argument("--encode_corpus", default=None,
                 help="sentences for --encode (first lines); default: the shared wiki excerpt, else random words")
  p.add_argument("--profile", metavar="DIR", help="write the jax.profiler trace of the breakdown's full steps here")
  p.add_argument("--output", help="also write the JSON result to this file (rewritten after each row)")
  p.add_argument("--rows", help="append each measured row to this JSON-lines file as it is measured")
  host.add_arguments(p)
  p.add_argument("--collectives", action="store_true",
                 help="instead: collectives and memory per device of the compiled BERT-base step for the "
                      "current devices, state replicated vs sharded, with and without remat (bench/scaling.py)")
  p.add_argument("--aot", metavar="TARGET", choices=TARGETS,
                 help="instead: compile the step and the encode program for a GPU/TPU that is not here ("
                      + ", ".join(TARGETS) + ") and report kernels by kind and phase, memory per device, "
                      "collectives (bench/aot.py; needs the extra 'aot' or 'tpu')")
  p.add_argument("--encode_attention", action="store_true",
                 help="instead: encode throughput with the fused attention (cuDNN flash attention on a GPU in "
                      "bfloat16/float16) against the explicit softmax, in --dtype (bench/encode.py)")
  p.add_argument("--aot_hlo", metavar="FILE", help="with --aot TARGET: predict a saved optimized-HLO file's step time (aot/time_model.py)")
  p.add_argument("--devices", type=int, default=1, help="with --aot: devices of the target topology")
  p.add_argument("--cuda_graphs", choices=("auto", *CUDA_GRAPHS), default="auto", help="the step's "
                 "mesh.cuda_graphs (training/xla_options.py); with --aot_hlo: how the saved program was compiled")
  p.add_argument("--population", type=_at_least_one, default=0, metavar="K",
                 help="with --aot: compile the step of a population of K runs (training/population.py) instead")
  p.add_argument("--population_members", metavar="K,K,...", help="instead: population training of these sizes "
                 "measured here, and the paper's few-shot protocol in device-hours (bench/population.py)")
  p.add_argument("--collectives_layouts", default=",".join(scaling.LAYOUTS),
                 help="with --collectives: comma-separated state/remat layouts to compile")
  args = p.parse_args(argv)
  modes = args.torch_mode.split(",")
  if not modes or any(m not in TORCH_MODES for m in modes):
    p.error(f"--torch_mode {args.torch_mode!r}: comma-separated choices of {', '.join(TORCH_MODES)}")
  if min(args.batch_size, args.steps, args.rounds, args.devices) < 1 or args.max_length < 4:
    p.error("--batch_size, --steps, --rounds and --devices must be >= 1, --max_length >= 4")
  if args.population_members is not None and not _positive_ints(args.population_members):
    p.error(f"--population_members {args.population_members!r}: comma-separated population sizes >= 1")
  if args.population and not args.aot:
    p.error("--population K (K >= 1) goes with --aot")
  if args.aot and args.dtype == "auto":
    p.error("--aot needs an explicit --dtype (float32, bfloat16 or float16): 'auto' reads the local device")
  return args


def _chunk_size(text: str) -> str:
  """argparse's type of --chunk_size: "auto" or an integer >= 0, kept as text (the config's)."""
  if text == "auto" or text.isdigit():
    return text
  raise argparse.ArgumentTypeError(f"must be auto or an integer >= 0, got {text!r}")


def _at_least_one(text: str) -> int:
  """An integer >= 1 (argparse's `type`: anything else is its one-line usage error, `--population 0` too,
  which the default 0, no population, would otherwise have hidden)."""
  if not text.strip().isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
  return int(text)


def _positive_ints(text: str) -> list[int]:
  """`1,5,25` -> [1, 5, 25]; [] unless every item is an integer >= 1."""
  items = text.split(",")
  if not all(i.strip().isdigit() and int(i) >= 1 for i in items):
    return []
  return [int(i) for i in items]


def run(args, rows: Rows | None = None) -> dict:
  """Measures everything `args` asks for; each part goes to `rows` as soon as it is measured."""
  import transformers
  model_dir = jax_step.model_dir_for(args.model)
  vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
  batch = jax_step.random_batch(args.batch_size, args.max_length, vocab)
  result = {"model": args.model, "batch_size": args.batch_size, "max_length": args.max_length,
            "dtype": args.dtype, "device": hardware.device_kind(), "num_devices": jax.device_count(),
            "jax_version": jax.__version__, "dropout_random_bits": args.dropout_random_bits}
  rows = rows or Rows({})
  rows.add("setup", header_lines, **result)
  def overrides(config):
    config.model.dropout_random_bits = args.dropout_random_bits
    config.mesh.cuda_graphs = args.cuda_graphs
    config.chunk_size = args.chunk_size
  step = jax_step.JaxStep(model_dir, batch, args.dtype, overrides, steps=args.steps_per_dispatch)
  compile_s, flops = step.compile()
  kernels = hlo.summary(hlo_module.parse(step.compiled.as_text()))  # the program this machine runs (autotuned on GPU)
  rows.add("compile", compile_lines, compile_s=compile_s, step_flops=flops, model_flops=step.model_flops,
           chunk_size=args.chunk_size, chunk_size_resolved=int(step.program.config.chunk_size),
           kernels_per_step=kernels["kernels_per_step"], update_kernels_per_step=kernels["update_kernels_per_step"])
  t = timing.measure(*timing.jax_peer(step), args.warmup, args.steps, args.rounds, step.steps)
  model_flops = step.model_flops
  mfu = lambda ms: hardware.mfu(model_flops, ms / 1e3, args.dtype)
  rows.add("jax", jax_lines, timing=timing.PIPELINED.format(steps=args.steps, rounds=args.rounds), jax=dict(
      t, sentences_per_s=1e3 * args.batch_size / t["pipelined_step_ms"], mfu=mfu(t["pipelined_step_ms"]),
      mfu_blocked=mfu(t["blocked_step_ms"]), peak_device_bytes=hardware.peak_device_bytes(),
      peak_host_rss_bytes=hardware.peak_host_rss_bytes()))
  if args.profile or not args.no_breakdown:
    directory = args.profile or tempfile.mkdtemp(prefix="micse_bench_trace_")
    summary = step.phase_ms(directory, args.piece_steps)  # op time by kind and by phase
    if not args.no_breakdown:
      rows.add("breakdown", breakdown_lines, breakdown_ms=summary["ms_per_step_by_phase"])
    if args.profile:
      rows.add("profile", profile_lines, profile=summary, profile_dir=args.profile)
  del step
  for mode in [] if args.no_torch else args.torch_mode.split(","):
    from micse_jax.bench.torch_step import torch_benchmark
    t = torch_benchmark(model_dir, batch, args.dtype, args.warmup, args.steps, args.rounds, mode)
    t.update(sentences_per_s=1e3 * args.batch_size / t["pipelined_step_ms"], mode=mode)
    key, j = TORCH_RESULT_KEYS[mode], rows.result["jax"]
    rows.add(key, torch_lines(key), **{key: t, f"speedup_vs_{key}": t["pipelined_step_ms"] / j["pipelined_step_ms"],
                                       f"speedup_vs_{key}_blocked": t["blocked_step_ms"] / j["blocked_step_ms"]})
  if args.encode:
    from micse_jax.bench import encode
    corpus = args.encode_corpus or _default_corpus()
    sentences, source = encode.sentences_for_benchmark(args.encode_sentences, corpus)
    rows.add("encode", encode_lines, encode=dict(
        encode.encode_benchmark(model_dir, sentences, args.encode_batch_size, 128), source=source))
  return rows.result


def _default_corpus() -> str:
  from micse_jax.paths import corpus_path
  return corpus_path("wiki1m_head.txt")


def _gib(b) -> str:
  return "n/a" if b is None else f"{b / 2 ** 30:.2f} GiB"


def header_lines(r: dict) -> list[str]:
  """The first line: model, shape, dtype, devices, jax version."""
  return [f"micse_jax.bench: {r['model']}, {r['batch_size']} sentences x 2 views x {r['max_length']} tokens, "
          f"{r['dtype']}, {r['num_devices']} x {r['device']} (jax {r['jax_version']})"]


def compile_lines(r: dict) -> list[str]:
  """Compile time, the step's model FLOPs (training/flops.py) and XLA's own count."""
  return [f"  train step compile time      {r['compile_s']:.1f} s   "
          f"(model FLOPs/step {r['model_flops']:.3g}; XLA's count {r['step_flops'] or float('nan'):.3g})",
          f"  chunk_size                   {aot.chunk_line(r)}",
          f"  kernels per step             {r['kernels_per_step']} (update {r['update_kernels_per_step']}; "
          "aot/hlo.py)"]


def _pct(x) -> str:
  return "n/a" if x is None else f"{100 * x:.1f}%"


def jax_lines(r: dict) -> list[str]:
  """The micse_jax step: time (pipelined, blocked), throughput, peak memory, MFU."""
  j = r["jax"]
  mfu = ("n/a (CPU, or no known peak for this device)" if j["mfu"] is None
         else f"{_pct(j['mfu'])} (blocked {_pct(j['mfu_blocked'])})")
  return [f"  step times: {r['timing']}; ratios, sentences/s and MFU use the pipelined time",
          f"  micse_jax step               {j['pipelined_step_ms']:.2f} ms pipelined, {j['blocked_step_ms']:.2f} ms "
          f"blocked   ({j['sentences_per_s']:.1f} sentences/s; {j['steps_per_call']} step(s) per call)",
          f"  host dispatch per step       {j['dispatch_step_ms']:.2f} ms ({j['dispatch_step_ms'] / j['pipelined_step_ms']:.2f} "
          "of the pipelined step: near 1, the host sets the pace)",
          f"  peak memory: device {_gib(j['peak_device_bytes'])}, host RSS {_gib(j['peak_host_rss_bytes'])}",
          f"  MFU (model FLOPs / pipelined step time / device peak)  {mfu}"]


TORCH_RESULT_KEYS = {"eager": "torch", "compiled": "torch_compiled"}  # mode -> the result's key
TORCH_LABELS = {"torch": "PyTorch (eager, public code)", "torch_compiled": "PyTorch (torch.compile)"}


def torch_lines(key: str):
  """The report lines of one PyTorch peer (`key` of `TORCH_RESULT_KEYS`): its step and ratio to micse_jax's."""
  def lines(r: dict) -> list[str]:
    t, label = r[key], TORCH_LABELS[key]
    return [f"  {label + ' step':<34}{t['pipelined_step_ms']:.2f} ms pipelined, {t['blocked_step_ms']:.2f} ms blocked"
            f"   ({t['sentences_per_s']:.1f} sentences/s), peak device memory {_gib(t['peak_device_bytes'])}",
            f"  ratio {label} / micse_jax    {r[f'speedup_vs_{key}']:.2f}x pipelined "
            f"({r[f'speedup_vs_{key}_blocked']:.2f}x blocked)"]
  return lines


def breakdown_lines(r: dict) -> list[str]:
  """The step's op time by phase (its named scopes), from a profile of full steps."""
  total = sum(r["breakdown_ms"].values())
  lines = ["  breakdown by phase (profile of full steps; each op under the step's named scope, "
           "forward / backward inside the gradient):"]
  for phase, ms in r["breakdown_ms"].items():
    lines.append(f"    {phase:<44} {ms:9.1f} ms  {100 * ms / total:5.1f}%")
  return lines + [f"    {'op time per step':<44} {total:9.1f} ms"]


def encode_lines(r: dict) -> list[str]:
  """Encode throughput against sentence-transformers'."""
  e = r["encode"]
  return [f"  encode ({e['sentences']} sentences from {e['source']}, batch {e['batch_size']}, mean pooling):",
          f"    micse_jax SentenceEncoder.encode        {e['micse_jax_sentences_per_s']:.1f} sentences/s",
          f"    sentence-transformers encode            {e['sentence_transformers_sentences_per_s']:.1f} sentences/s",
          f"    ratio                                   {e['speedup_vs_sentence_transformers']:.2f}x "
          f"(mean cosine between the two embeddings {e['mean_cosine_between_the_two']:.4f})"]


def profile_lines(r: dict) -> list[str]:
  """The profile's time by op / kernel kind and where the trace is."""
  return trace_summary.report_lines(r["profile"]) + [f"  profiler trace written to {r['profile_dir']}"]


SECTIONS = (("compile_s", compile_lines), ("jax", jax_lines), ("torch", torch_lines("torch")),
            ("torch_compiled", torch_lines("torch_compiled")), ("breakdown_ms", breakdown_lines),
            ("encode", encode_lines), ("profile_dir", profile_lines))


def report(result: dict) -> str:
  """The human-readable summary of `result` (every section it has, in reading order)."""
  lines = header_lines(result)
  for key, section in SECTIONS:
    if key in result:
      lines += section(result)
  return "\n".join(lines)


def run_aot(args) -> dict:
  """`--aot TARGET`: compiles on this CPU for the target, prints the report and the JSON line."""
  from micse_jax import cli
  jax.config.update("jax_platforms", "cpu")  # the target is not here; compile on the host
  with cli.input_errors_as_one_line():
    result = aot.run(args.aot, args.devices, args.model, args.batch_size, args.max_length, args.dtype,
                     encode=args.encode and not args.population, population=args.population, cuda_graphs=args.cuda_graphs,
                     steps=args.steps_per_dispatch, chunk_size=args.chunk_size)
  print("\n".join(aot.report_lines(result)))
  if args.output:
    jsonio.write_json(args.output, result)
  print(json.dumps(result))
  sys.stdout.flush()
  return result


def run_encode_attention(args) -> dict:
  """`--encode_attention`: fused against explicit attention in encode, printed, then the JSON line."""
  from micse_jax.bench import encode
  sentences, source = encode.sentences_for_benchmark(args.encode_sentences, args.encode_corpus or _default_corpus())
  result = dict(encode.attention_comparison(jax_step.model_dir_for(args.model), sentences, args.encode_batch_size,
                                            128, args.dtype), source=source, device=hardware.device_kind())
  print(f"encode attention ({result['dtype']}, {result['sentences']} sentences, {result['device']}): fused "
        f"{result['fused_sentences_per_s']:.1f} sentences/s (cuDNN attention calls in its program: "
        f"{result['cudnn_attention_calls']}), explicit {result['explicit_sentences_per_s']:.1f} sentences/s, "
        f"ratio {result['speedup_fused_over_explicit']:.2f}x, largest difference {result['max_abs_difference']:.2g}")
  if args.output:
    jsonio.write_json(args.output, result)
  print(json.dumps(result))
  return result


def run_population(args) -> dict:
  """`--population_members K,...`: population training measured here, printed, then the JSON line."""
  from micse_jax.bench import population
  result = population.run(jax_step.model_dir_for(args.model), _positive_ints(args.population_members),
                          args.batch_size, args.max_length, args.dtype, args.steps, args.warmup)
  result.update(model=args.model, batch_size=args.batch_size, max_length=args.max_length, dtype=args.dtype,
                device=hardware.device_kind(), num_devices=jax.device_count())
  print(f"population training ({args.model}, batch {args.batch_size} x {args.max_length} tokens, {args.dtype}, "
        f"{result['num_devices']} x {result['device']}):")
  print("\n".join(population.report_lines(result)))
  if args.output:
    jsonio.write_json(args.output, result)
  print(json.dumps(result))
  return result


def main(argv=None) -> dict:
  """Command-line entry: runs, prints the report and the JSON row; returns the row."""
  args = parse_args(argv)
  if args.host:
    return host.run(args)
  if args.aot_hlo:
    from micse_jax.aot import time_model
    return time_model.run_saved(args.aot_hlo, args.aot, args.output, members=args.population or 1,
                                cuda_graphs=args.cuda_graphs)
  if not args.encode_attention:  # the trainer's checks of the shape against the model, before anything compiles
    aot.check_shape("bert-base" if args.collectives else args.model, args.batch_size, args.max_length)
    aot.check_chunk(args.chunk_size, args.batch_size, args.devices if args.aot else jax.device_count(),
                    args.population)
  if args.aot:
    return run_aot(args)
  if args.encode_attention:
    return run_encode_attention(args)
  if args.population_members:
    return run_population(args)
  if args.collectives:
    result = scaling.run(args.collectives_layouts.split(","), args.batch_size, args.max_length, args.dtype)
    if args.output:
      jsonio.write_json(args.output, result)
  else:
    if not args.no_torch:  # before anything is compiled or written: a missing peer is one line at once
      require("torch", "the PyTorch baseline of the bench (or pass --no_torch)")
    result = run(args, Rows({}, rows_path=args.rows, output_path=args.output))
  print(json.dumps(result))
  sys.stdout.flush()
  return result


def entry(argv=None) -> None:
  """`python -m micse_jax.bench`: `main`, with a user error (a missing optional package, a model
  path that does not load, ...: any `MicseError`) as one `error:` line and exit 1; anything else
  keeps its traceback."""
  cli.cpu_when_no_gpu()
  try:
    main(argv)
  except MicseError as e:
    cli.fail(one_line(e))


if __name__ == "__main__":
  entry()
