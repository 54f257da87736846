"""`python -m micse_jax.bench --aot TARGET`: the bench's miCSE step compiled deviceless for a GPU or TPU
that is not here, reported (the compile and the reading are the library's, `micse_jax/aot/`).

    python -m micse_jax.bench --aot h100 --model bert-base --batch_size 50 --dtype bfloat16
    python -m micse_jax.bench --aot tpu-v5e --devices 4 --model bert-base --batch_size 512

The program is the trainer's (`training/program.py`, compiled by `aot/compile.py`) for the bench's
miCSE config (`bench/jax_step.bench_config`) on a named shape or a model directory's config, with
the encode program (`SentenceEncoder._embed`, eval mode) beside it; no weights are needed. The
report: kernels per step by kind and by phase (`aot/hlo.py`), the update's kernels, the compiler's
memory per device, collectives (`aot/collectives.py`), compile time, and the step time the time
model predicts for the target (`aot/time_model.py`). Needs the optional extra `aot` (GPU) or `tpu`;
see docs/AOT.md.
"""
from __future__ import annotations

import jax

from micse_jax.aot import compile as aot_compile
from micse_jax.aot import hlo, hlo_module, time_model
from micse_jax.aot.topology import target_devices
from micse_jax.bench.jax_step import SHAPES, bench_config, model_dir_for
from micse_jax.errors import ConfigError
from micse_jax.models.bert import BertConfig
from micse_jax.models.loading import load_config


def bert_config_for(model: str):
  """The BertConfig of a named shape (bench SHAPES) or of a model directory's config.json."""
  if model in SHAPES:
    return BertConfig(**SHAPES[model])
  return load_config(model_dir_for(model))


def compile_config(model: str, bert_config, batch_size: int, max_length: int, dtype: str, population: int = 0):
  """The bench's miCSE config at this shape; `population` K > 0: K members (seeds 1..K)."""
  config = bench_config(model, bert_config.num_hidden_layers, batch_size, max_length, dtype)
  if population:
    config.population.seeds = tuple(range(1, population + 1))
  return config


def check_shape(model: str, batch_size: int, max_length: int) -> None:
  """The trainer's checks of the bench's config against its model (`run_inputs.check_against_model`:
  `--max_length` within the model's positions, the AMI layers it has), as one `ConfigError`."""
  from micse_jax.training.run_inputs import check_against_model  # optax, Orbax: only for this check
  bert_config = bert_config_for(model)
  try:
    check_against_model(compile_config(model, bert_config, batch_size, max_length, "float32"), bert_config)
  except ConfigError as e:
    raise ConfigError(f"--model {model} --max_length {max_length}: {e}") from e


def check_chunk(chunk_size: str, batch_size: int, num_devices: int, population: int = 0) -> None:
  """The trainer's check of a numeric `--chunk_size` against the padded batch and the devices its rows are
  split over (`config_checks.check_chunk_size`), before anything compiles or is written."""
  from micse_jax.config_checks import check_chunk_size
  from micse_jax.training import data_parallel, population_placement
  row_devices = population_placement.row_devices(population, num_devices)
  check_chunk_size(chunk_size, data_parallel.padded_batch_size(batch_size, row_devices), row_devices)


def run(target: str, num_devices: int, model: str, batch_size: int, max_length: int, dtype: str,
        encode: bool = True, population: int = 0, cuda_graphs: str = "auto", steps: str = "auto",
        chunk_size: str = "0") -> dict:
  """Compiles the step (and the encode program) for `target`; returns the JSON-able report.
  `population` K > 0: the step of K stacked runs, with its kernels and memory per member-step;
  `cuda_graphs`: the step's `mesh.cuda_graphs` (compiled and priced so); `steps`: its
  `steps_per_dispatch` (auto: as the trainer chooses for the target); `chunk_size`: its GradCache block
  (`training/grad_cache.py`; auto: the largest that fits the target's memory, `training/chunk_choice.py`)."""
  devices = target_devices(target, num_devices)
  bert_config = bert_config_for(model)
  config = compile_config(model, bert_config, batch_size, max_length, dtype, population)
  config.mesh.cuda_graphs, config.steps_per_dispatch, config.chunk_size = cuda_graphs, str(steps), str(chunk_size)
  try:
    prog, compile_s = aot_compile.compiled_program(config, bert_config, devices)
  except jax.errors.JaxRuntimeError as e:  # e.g. v100: CUDA 13's ptxas compiles nothing for sm_70
    raise ConfigError(f"--aot {target}: the installed compiler refuses this target: {str(e).splitlines()[0]}") from e
  module = hlo_module.parse(prog.executable.as_text())  # read once by the report and the time model
  result = {"aot_target": target, "device_kind": devices[0].device_kind, "num_devices": len(devices),
            "model": model, "batch_size": batch_size, "max_length": max_length, "dtype": dtype,
            "jax_version": jax.__version__, "compile_s": compile_s, "steps_per_dispatch": prog.steps,
            "chunk_size": str(chunk_size), "chunk_size_resolved": int(prog.config.chunk_size),
            "state_layout": "sharded" if prog.config.mesh.shard_state else "replicated",
            **aot_compile.report(prog.executable, module, len(devices), population)}
  result.update(time_model.predict(module, target, members=population or 1,
                                   cuda_graphs=prog.cuda_graphs))  # aot/time_model.py
  if encode:
    enc, enc_s = aot_compile.compile_encode(devices[0], bert_config, batch_size, max_length, dtype)
    enc_kernels = hlo.summary(hlo_module.parse(enc.as_text()))
    result.update(encode_compile_s=enc_s, encode_kernels=enc_kernels["kernels_per_step"],
                  encode_by_kind=enc_kernels["by_kind"],
                  encode_cudnn_attention_calls=enc_kernels["by_kind"].get("attention (cuDNN)", 0),
                  encode_peak_bytes=aot_compile.memory(enc)["peak"])
  return result


def chunk_line(r: dict) -> str:
  """`chunk_size` as asked and as the step runs it (training/grad_cache.py; auto: training/chunk_choice.py)."""
  size = r["chunk_size_resolved"]
  runs = "the whole batch in one block" if size in (0, r["batch_size"]) else f"blocks of {size} rows"
  return f"{r['chunk_size']}" + (f" -> {size}" if r["chunk_size"] != str(size) else "") + f" ({runs})"


def report_lines(r: dict) -> list[str]:
  """The human-readable report of `run`'s result."""
  gib = lambda b: f"{b / 2 ** 30:.2f} GiB"
  lines = [f"micse_jax.bench --aot {r['aot_target']}: {r['model']}, {r['batch_size']} sentences x 2 views x "
           f"{r['max_length']} tokens, {r['dtype']}, {r['num_devices']} x {r['device_kind']} "
           f"(compiled deviceless, jax {r['jax_version']})",
           f"  train step compile time      {r['compile_s']:.1f} s   ({r['steps_per_dispatch']} step(s) per call; "
           "figures below are per training step)",
           *([f"  chunk_size                   {chunk_line(r)}"] if "chunk_size_resolved" in r else []),
           f"  train state                  {r['state_layout']}"
           + ("   (FSDP: mesh.shard_state)" if r["state_layout"] == "sharded" else ""),
           f"  kernels per step             {r['kernels_per_step']}   (update: {r['update_kernels_per_step']} = "
           f"{', '.join(hlo.UPDATE_PHASES)})", "  by kind:"]
  lines += [f"    {kind:<36} {n:>6}" for kind, n in r["by_kind"].items()]  # per step: a loop's may be fractional
  lines.append("  by phase (jvp = forward inside the gradient, transpose = backward):")
  lines += [f"    {phase:<36} {n:>6}" for phase, n in r["by_phase"].items()]
  lines.append("  update kernels by kind: " + ", ".join(f"{k} {n}" for k, n in r["update_by_kind"].items()))
  m = r["memory_per_device"]
  lines.append(f"  memory per device: peak {gib(m['peak'])} (arguments {gib(m['arguments'])}, outputs "
               f"{gib(m['outputs'])}, aliased {gib(m['aliased'])}, temporaries {gib(m['temporaries'])})")
  if r.get("population"):
    lines.append(f"  population of {r['population']}: {r['kernels_per_member_step']:.1f} kernels and "
                 f"{gib(r['peak_bytes_per_member'])} of peak memory per member")
  used = {k: v for k, v in r["collectives"].items() if v["count"]}
  lines.append("  collectives: " + (", ".join(f"{k} {v['count']} ({v['bytes'] / 2 ** 20:.1f} MiB)"
                                               for k, v in used.items()) or "none"))
  lines += time_model.report_lines(r)
  if "encode_kernels" in r:
    lines.append(f"  encode program: {r['encode_kernels']} kernels, cuDNN attention calls "
                 f"{r['encode_cudnn_attention_calls']}, peak {gib(r['encode_peak_bytes'])}, "
                 f"compile {r['encode_compile_s']:.1f} s")
  return lines
