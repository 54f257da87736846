"""THE trainer's program, compiled for devices that need not be here (deviceless AOT), and what the
compiled program says.

`compile_program(config, bert_config, devices)` builds the step exactly as the trainer does
(`training/program.build`: networks, optimizer, abstract state, shardings, packed batch layout,
a population's vmapped step and step inputs) from the model's shapes alone (`program.abstract_encoder`:
no weights, no data) and runs the devices' compiler on this CPU; the devices are this machine's
or a target's (`aot/topology.py`). `report` reads the compiled program: its kernels by kind and by
phase of the step (`aot/hlo.py`), the update's kernels, the compiler's memory per device and the
collectives (`aot/collectives.py`). `studies/population_size` sizes populations with it; `python -m
micse_jax.bench --aot TARGET` prints it.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import SingleDeviceSharding

from micse_jax.aot import hlo
from micse_jax.aot.collectives import collective_table
from micse_jax.aot.hlo_module import Module
from micse_jax.kernels.choice import target_of
from micse_jax.models.bert import BertConfig, BertModel
from micse_jax.models.policy import Policy

# `training/` and `encoder` are imported in the functions that build programs: they bring the
# optimizer and checkpoint stack (optax, Orbax), which the bench's other modes, importing this
# module through `bench/aot.py`, do not need.


def build_program(config: ml_collections.ConfigDict, bert_config: BertConfig, devices, tokens=None):
  """The trainer's program of `config` (`training/program.py`) for `devices`, from shapes alone;
  `tokens`: the checkpoint's special token ids (`networks.SpecialTokens`), where the method reads them."""
  from micse_jax.aot.topology import datasheet_memory
  from micse_jax.training import chunk_choice, precision, program
  config = precision.with_resolved_dtype(config, announce=False, device=devices[0])  # "auto": the target's dtype
  encoder = program.abstract_encoder(program.step_config(config), bert_config)
  with chunk_choice.deviceless_memory(datasheet_memory):  # `chunk_size=auto` against the target's datasheet
    return program.build(config, bert_config, encoder, devices, tokens)


def lower_program(config: ml_collections.ConfigDict, bert_config: BertConfig, devices, tokens=None):
  """`build_program`'s step lowered for `devices`."""
  return build_program(config, bert_config, devices, tokens).lower()


def compiled_program(config: ml_collections.ConfigDict, bert_config: BertConfig, devices, tokens=None):
  """(program, lowering + compile seconds): `build_program`'s, compiled as the trainer compiles it
  (`program.compiled`: our kernels, else the explicit path); its config holds the layout chosen. With
  `chunk_size=auto` the seconds are those of every size tried (`training/chunk_choice.py`)."""
  from micse_jax.training import program
  start = time.perf_counter()
  prog = build_program(config, bert_config, devices, tokens)
  if prog.executable is None:  # not compiled by auto's tries: only the compile is timed
    start = time.perf_counter()
  prog = program.compiled(prog)
  return prog, time.perf_counter() - start


def compile_program(config: ml_collections.ConfigDict, bert_config: BertConfig, devices, tokens=None):
  """(compiled step, lowering + compile seconds) of `compiled_program`."""
  prog, seconds = compiled_program(config, bert_config, devices, tokens)
  return prog.executable, seconds


def compile_encode(device, bert_config: BertConfig, batch_size: int, max_length: int, dtype: str):
  """(compiled encode program, compile seconds): `SentenceEncoder._embed` (eval mode, CLS) on one device."""
  from micse_jax.encoder import SentenceEncoder
  bert = BertModel(bert_config, dtype=jnp.dtype(dtype), policy=Policy(target=target_of([device])))
  ids = jnp.zeros((1, max_length), jnp.int32)
  params = jax.eval_shape(lambda: bert.init(jax.random.PRNGKey(0), ids, jnp.ones_like(ids))["params"])
  sharding = SingleDeviceSharding(device)
  tokens = jax.ShapeDtypeStruct((batch_size, max_length), jnp.int32, sharding=sharding)
  batch = {"input_ids": tokens, "attention_mask": tokens, "token_type_ids": tokens}
  placed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), params)
  start = time.perf_counter()
  compiled = SentenceEncoder._embed.lower(SentenceEncoder(bert, None, tokenizer=None), placed, None, batch,
                                          "cls_before_pooler").compile()
  return compiled, time.perf_counter() - start


def memory(compiled) -> dict:
  """The compiler's buffer sizes per device (bytes); peak = arguments + outputs − aliased + temporaries
  (`training/chunk_choice.compiled_memory`, which `chunk_size=auto` reads)."""
  from micse_jax.training.chunk_choice import compiled_memory
  return compiled_memory(compiled)


def report(compiled, module: Module, num_devices: int, members: int = 0) -> dict:
  """What a compiled step says (`module`: its text parsed, `hlo_module.parse`): kernels by kind and
  phase (`aot/hlo.summary`), memory per device, collectives; for a population of `members`, kernels
  and peak memory per member-step too."""
  kernels, mem = hlo.summary(module), memory(compiled)
  result = {**kernels, "memory_per_device": mem, "peak_bytes_per_device": mem["peak"],
            "collectives": collective_table(module)}
  if members:
    result.update(population=members, kernels_per_member_step=kernels["kernels_per_step"] / members,
                  peak_bytes_per_member=mem["peak"] * num_devices / members)
  return result
