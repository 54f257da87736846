"""The train step and the encode program compiled for a GPU or TPU that is not here (deviceless AOT).

    python -m micse_jax.bench --aot h100 --model bert-base --batch_size 50 --dtype bfloat16
    python -m micse_jax.bench --aot tpu-v5e --devices 4 --model bert-base --batch_size 512

JAX compiles for a target it does not run on: `jax.experimental.topologies.get_topology_desc`
gives the devices of a GPU topology (from a `GpuTargetConfigProto`, our `bench/targets/*.txtpb`)
or of a TPU slice (libtpu), and `jax.jit(...).lower(...).compile()` on shapes placed on those
devices runs the target's whole compiler on this CPU (no autotuning: XLA's default tiles).
The real step (`training/step.make_train_step` on the set-up of `training/setup.py`, the
bench's miCSE config) and the real encode program (`SentenceEncoder._embed`, eval mode) are
compiled; no weights are needed (`jax.eval_shape`). The report: kernels per step by kind and
by phase (`bench/hlo.py`, from the step's `jax.named_scope`s), the update's kernels,
the compiler's memory per device, collectives (`aot/collectives.py`), compile time.

Needs the optional extra `aot` (GPU: the jax-cuda13 plugin and PJRT wheels of the installed
jax; cuDNN's libcudnn for cuDNN attention) or `tpu` (libtpu); see docs/AOT.md.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from micse_jax.aot import hlo
from micse_jax.aot.collectives import collective_table
from micse_jax.aot.targets import target_devices
from micse_jax.errors import ConfigError


def bert_config_for(model: str):
  """The BertConfig of a named shape (bench SHAPES) or of a model directory's config.json."""
  from micse_jax.bench.jax_step import SHAPES, model_dir_for
  from micse_jax.models.bert import BertConfig
  from micse_jax.models.loading import load_config
  if model in SHAPES:
    return BertConfig(**SHAPES[model])
  return load_config(model_dir_for(model))


def _placed(shapes, shardings):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def abstract_state(config, bert_config, nets, tx):
  """The step-0 train state's shapes by the trainer's set-up (`training/setup.py`), never materialised
  (with the checkpoint's MLM head where the method reads it, as `setup.prepare` loads it)."""
  from micse_jax import config_checks
  from micse_jax.models.bert import BertModel
  from micse_jax.training import setup
  ids = jnp.zeros((1, config.model.max_length), jnp.int32)
  encoder_model = BertModel(bert_config, add_mlm_head=True) if config_checks.needs_mlm_head(config) else nets.online

  def init():
    encoder = encoder_model.init(jax.random.PRNGKey(0), ids, jnp.ones_like(ids))["params"]
    params, frozen = setup.initial_params(config, nets, encoder)
    return setup.new_train_state(config, bert_config.hidden_size, tx, params, frozen)
  return jax.eval_shape(init)


def abstract_batch(rows: int, max_length: int, sharding, padded: bool) -> dict:
  """A token batch's shapes (with `row_mask` when the batch was padded to the devices)."""
  from micse_jax.data.pipeline import ROW_MASK_KEY, SENTENCE_IDS_KEY
  tokens = jax.ShapeDtypeStruct((rows, max_length), jnp.int32, sharding=sharding)
  batch = {"input_ids": tokens, "attention_mask": tokens, "token_type_ids": tokens,
           SENTENCE_IDS_KEY: jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding)}
  if padded:
    batch[ROW_MASK_KEY] = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding)
  return batch


def compile_step(devices, model: str, batch_size: int, max_length: int, dtype: str, overrides=None):
  """(compiled train step, compile seconds, config) of the bench's miCSE step on `devices`."""
  from jax.sharding import NamedSharding, PartitionSpec

  from micse_jax.bench.jax_step import bench_config
  from micse_jax.training import mesh as mesh_lib
  from micse_jax.training.networks import build_networks
  from micse_jax.training.optim import learning_rate_schedule, make_optimizer
  from micse_jax.training.step import make_train_step
  bert_config = bert_config_for(model)
  config = bench_config(model, bert_config.num_hidden_layers, batch_size, max_length, dtype)
  if overrides:
    overrides(config)
  nets, tx, mesh = build_networks(config, bert_config), make_optimizer(config), mesh_lib.data_mesh(devices)
  shapes = abstract_state(config, bert_config, nets, tx)
  shardings = mesh_lib.state_sharding(shapes, mesh, config.mesh.shard_state, config.mesh.shard_min_elements)
  rows = mesh_lib.padded_batch_size(batch_size, len(devices))
  batch = abstract_batch(rows, max_length, mesh_lib.batch_sharded(mesh), rows != batch_size)
  step = make_train_step(config, nets, tx, learning_rate_schedule(config), mesh)
  jitted = jax.jit(step, in_shardings=(shardings, mesh_lib.batch_sharded(mesh)),
                   out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())), donate_argnums=0)
  start = time.perf_counter()
  compiled = jitted.lower(_placed(shapes, shardings), batch).compile()
  return compiled, time.perf_counter() - start, config


def compile_population_step(devices, model: str, batch_size: int, max_length: int, dtype: str, members: int):
  """(compiled step, compile seconds) of a population of `members` runs of the bench's miCSE step
  (`training/population.py`: states stacked, the step vmapped) on `devices`, as the trainer
  places it (whole members per device when the devices divide them, else rows split)."""
  from micse_jax.bench.jax_step import bench_config
  bert_config = bert_config_for(model)
  config = bench_config(model, bert_config.num_hidden_layers, batch_size, max_length, dtype)
  config.population.seeds = tuple(range(1, members + 1))
  return compile_population_config(devices, config, bert_config)


def compile_population_config(devices, config, bert_config, tokens=None):
  """(compiled step, compile seconds) of the population step of a training `config` whose
  `population.seeds` holds K members, on `devices` (abstract shapes: no weights, no data): the
  trainer's networks (`tokens`: the checkpoint's special token ids, `networks.SpecialTokens`),
  optimizer, state, placement and batch layout. `model.dtype="auto"` is resolved for `devices[0]`."""
  import numpy as np

  from micse_jax.data.packing import BatchLayout
  from micse_jax.data.pipeline import ROW_MASK_KEY, SENTENCE_IDS_KEY, TOKEN_KEYS
  from micse_jax.models.dtypes import AUTO, device_dtype
  from micse_jax.training import mesh as mesh_lib
  from micse_jax.training import population
  from micse_jax.training.networks import build_networks
  from micse_jax.training.optim import learning_rate_schedule, make_optimizer
  config = config.copy_and_resolve_references()
  if config.model.dtype == AUTO:
    config.model.dtype = device_dtype(devices[0])
  members, batch_size, max_length = population.size(config), config.batch_size, config.model.max_length
  shared = population.optimizer_config(config)
  nets, tx = build_networks(shared, bert_config, tokens), make_optimizer(shared)
  mesh = population.population_mesh(members, devices)
  shapes = population.abstract_state(abstract_state(shared, bert_config, nets, tx), members)
  sharding = population.state_sharding(shapes, mesh)
  rows = mesh_lib.padded_batch_size(batch_size, len(devices))  # as `setup.prepare` pads a member's batch
  sample = {k: np.zeros((rows, max_length), np.int32) for k in TOKEN_KEYS}
  sample[SENTENCE_IDS_KEY] = np.zeros((rows,), np.int32)
  if rows != batch_size:
    sample[ROW_MASK_KEY] = np.ones((rows,), np.int32)
  layout = BatchLayout.of(sample)
  packed = jax.ShapeDtypeStruct((members, *layout.pack(sample).shape), jnp.int32,
                                sharding=population.batch_sharding(mesh))
  step = population.jit_population_step(shared, nets, tx, learning_rate_schedule(shared), layout, mesh, sharding)
  start = time.perf_counter()
  compiled = step.lower(_placed(shapes, sharding), packed, population.hyper(config)).compile()
  return compiled, time.perf_counter() - start


def compile_encode(device, model: str, batch_size: int, max_length: int, dtype: str):
  """(compiled encode program, compile seconds): `SentenceEncoder._embed` (eval mode, CLS) on one device."""
  from jax.sharding import SingleDeviceSharding

  from micse_jax.encoder import SentenceEncoder
  from micse_jax.models.bert import BertModel
  bert_config = bert_config_for(model)
  bert = BertModel(bert_config, dtype=jnp.dtype(dtype))
  ids = jnp.zeros((1, max_length), jnp.int32)
  params = jax.eval_shape(lambda: bert.init(jax.random.PRNGKey(0), ids, jnp.ones_like(ids))["params"])
  sharding = SingleDeviceSharding(device)
  tokens = jax.ShapeDtypeStruct((batch_size, max_length), jnp.int32, sharding=sharding)
  batch = {"input_ids": tokens, "attention_mask": tokens, "token_type_ids": tokens}
  encoder = SentenceEncoder(bert, None, tokenizer=None)
  start = time.perf_counter()
  compiled = SentenceEncoder._embed.lower(encoder, _placed(params, jax.tree.map(lambda _: sharding, params)), None,
                                  batch, "cls_before_pooler").compile()
  return compiled, time.perf_counter() - start


def memory(compiled) -> dict:
  """The compiler's buffer sizes per device (bytes); peak = arguments + outputs − aliased + temporaries."""
  m = compiled.memory_analysis()
  sizes = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes}
  return dict(sizes, peak=sizes["arguments"] + sizes["outputs"] - sizes["aliased"] + sizes["temporaries"])


def run(target: str, num_devices: int, model: str, batch_size: int, max_length: int, dtype: str,
        encode: bool = True, population: int = 0) -> dict:
  """Compiles the step (and the encode program) for `target`; returns the JSON-able report.
  `population` K > 0: the step of K stacked runs (`compile_population_step`), with its kernels and
  memory per member-step beside the totals."""
  devices = target_devices(target, num_devices)
  try:
    if population:
      compiled, compile_s = compile_population_step(devices, model, batch_size, max_length, dtype, population)
    else:
      compiled, compile_s, _ = compile_step(devices, model, batch_size, max_length, dtype)
  except jax.errors.JaxRuntimeError as e:  # e.g. v100: CUDA 13's ptxas compiles nothing for sm_70
    raise ConfigError(f"--aot {target}: the installed compiler refuses this target: {str(e).splitlines()[0]}") from e
  text = compiled.as_text()
  kernels = hlo.summary(text)
  mem = memory(compiled)
  result = {"aot_target": target, "device_kind": devices[0].device_kind, "num_devices": len(devices),
            "model": model, "batch_size": batch_size, "max_length": max_length, "dtype": dtype,
            "jax_version": jax.__version__, "compile_s": compile_s, **kernels,
            "memory_per_device": mem, "peak_bytes_per_device": mem["peak"],
            "collectives": collective_table(text)}
  if population:
    result.update(population=population, kernels_per_member_step=kernels["kernels_per_step"] / population,
                  peak_bytes_per_member=mem["peak"] * len(devices) / population)
  if encode:
    enc, enc_s = compile_encode(devices[0], model, batch_size, max_length, dtype)
    enc_kernels = hlo.summary(enc.as_text())
    result.update(encode_compile_s=enc_s, encode_kernels=enc_kernels["kernels_per_step"],
                  encode_by_kind=enc_kernels["by_kind"],
                  encode_cudnn_attention_calls=enc_kernels["by_kind"].get("attention (cuDNN)", 0),
                  encode_peak_bytes=memory(enc)["peak"])
  return result


def report_lines(r: dict) -> list[str]:
  """The human-readable report of `run`'s result."""
  gib = lambda b: f"{b / 2 ** 30:.2f} GiB"
  lines = [f"micse_jax.bench --aot {r['aot_target']}: {r['model']}, {r['batch_size']} sentences x 2 views x "
           f"{r['max_length']} tokens, {r['dtype']}, {r['num_devices']} x {r['device_kind']} "
           f"(compiled deviceless, jax {r['jax_version']})",
           f"  train step compile time      {r['compile_s']:.1f} s",
           f"  kernels per step             {r['kernels_per_step']}   (update: {r['update_kernels_per_step']} = "
           f"{', '.join(hlo.UPDATE_PHASES)})", "  by kind:"]
  lines += [f"    {kind:<36} {n:6d}" for kind, n in r["by_kind"].items()]
  lines.append("  by phase (jvp = forward inside the gradient, transpose = backward):")
  lines += [f"    {phase:<36} {n:6d}" for phase, n in r["by_phase"].items()]
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
  if "encode_kernels" in r:
    lines.append(f"  encode program: {r['encode_kernels']} kernels, cuDNN attention calls "
                 f"{r['encode_cudnn_attention_calls']}, peak {gib(r['encode_peak_bytes'])}, "
                 f"compile {r['encode_compile_s']:.1f} s")
  return lines
